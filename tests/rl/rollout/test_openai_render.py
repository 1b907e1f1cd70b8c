"""rl/rollout/openai_render.py without a server: what of a streamed text may be sent yet."""
from rl.rollout import openai_render as render


def test_a_stop_string_cuts_the_text_at_its_first_occurrence():
  assert render.cut_at_stop("abc STOP def STOP", ("STOP",)) == 4
  assert render.cut_at_stop("abc", ("STOP",)) is None


def test_the_start_of_a_stop_string_and_an_incomplete_character_are_held_back():
  assert render.hold_back("hello ST", ("STOP",)) == 2
  assert render.hold_back("hello", ("STOP",)) == 0
  assert render.hold_back("hello\ufffd", ()) == 1
  assert render.usage([[1, 2]], [render.Sample(ids=[3])]) == {
      "prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
