"""rl/rollout/openai_requests.py without a server: typed fields, refusals, chat messages (the
front's behaviour over HTTP is tests/rl/rollout/test_openai_http.py)."""
import pytest

from rl.rollout import openai_requests as req
from rl.rollout.engine import SamplingSettings


def test_a_field_is_checked_for_type_and_bounds_and_a_missing_one_is_its_default():
  assert req.get({"n": 2}, "n", int, 1, lo=1, hi=4) == 2
  assert req.get({}, "n", int, 1) == 1
  assert req.get({"t": 1}, "t", float) == 1.0
  with pytest.raises(req.ApiError, match="'n' must be in \\[1, 4\\], got 5"):
    req.get({"n": 5}, "n", int, 1, lo=1, hi=4)
  with pytest.raises(req.ApiError, match="'n' must be an integer"):
    req.get({"n": True}, "n", int, 1)
  with pytest.raises(req.ApiError, match="'model' is required"):
    req.get({}, "model", str)


def test_an_unsupported_setting_is_refused_and_its_neutral_value_accepted():
  req.refuse({"presence_penalty": 0, "best_of": 1}, req.COMPLETION_UNSUPPORTED)
  with pytest.raises(req.ApiError, match="'presence_penalty'=0.5 is not supported"):
    req.refuse({"presence_penalty": 0.5}, req.COMPLETION_UNSUPPORTED)


def test_chat_messages_map_developer_to_system_and_read_tool_call_arguments():
  out = req.chat_messages([
      {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
      {"role": "assistant", "content": None, "tool_calls": [
          {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}])
  assert out[0] == {"role": "system", "content": "be brief"}
  assert out[1]["tool_calls"] == [{"name": "f", "arguments": {"a": 1}}]
  with pytest.raises(req.ApiError, match="messages\\[0\\].role"):
    req.chat_messages([{"role": "robot", "content": "x"}])


def test_each_choice_draws_with_its_own_seed():
  s = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, seed=7)
  assert [req.seeded(s, i).seed for i in range(3)] == [7, 8, 9]
  unseeded = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, seed=None)
  assert req.seeded(unseeded, 2) is unseeded
