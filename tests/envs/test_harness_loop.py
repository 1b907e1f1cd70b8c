"""The agent loop in-process: trajectories, repair, nudge, TITO, masking and batching."""
import dataclasses

import numpy as np
import pytest

from envs.chat import ChatFormat
from envs.chat import load_tokenizer
from envs.harness import errors
from tests.envs import harness_fakes
from envs.harness.collate import batch_metrics
from envs.harness.collate import collate
from envs.harness.collate import group_train_mask
from envs.harness.agent_loop import LoopSettings
from envs.harness.agent_loop import NUDGE_TEXT
from envs.harness.agent_loop import run_episode
from envs.harness.policy import Action
from envs.harness.world import Episode
from envs.harness.world import EpisodeResult

SETTINGS = LoopSettings(
    max_turns=6, max_context=3000, max_tokens_per_turn=200, repair_attempts=2, nudge=True,
    nudge_fraction=0.2, nudge_once=True, world_start_timeout_s=10, model_timeout_s=10,
    tool_timeout_s=10, grade_timeout_s=10, episode_timeout_s=60, temperature=1.0, top_p=1.0,
    top_k=0)
WORLD = harness_fakes.FakeWorldSpec(facts=(("alpha", "412.5"), ("beta", "x" * 40)), answer="412.5")


@pytest.fixture(scope="module")
def fmt():
  return ChatFormat(load_tokenizer(), thinking=True)


def _episode(task=harness_fakes.lookup_task("alpha"), world=WORLD, **kw):
  return Episode(task_id=kw.pop("task_id", "t0"), prompt=task, world=world, **kw)


def _check_invariants(res, fmt, task=harness_fakes.lookup_task("alpha")):
  n = len(res.tokens)
  assert len(res.loss_mask) == n == len(res.rollout_logprobs)
  assert res.tokens[:res.prompt_len] == fmt.prompt_ids(_tools(), task)
  assert not any(res.loss_mask[:res.prompt_len])
  assert all(lp == 0.0 for lp, m in zip(res.rollout_logprobs, res.loss_mask) if not m)


def _tools():
  w = WORLD.start()
  try:
    return w.tools()
  finally:
    w.close()


def test_oracle_episode(fmt):
  res = run_episode(_episode(), harness_fakes.LookupOracle(fmt), fmt, SETTINGS)
  assert res.outcome == errors.OK, res.detail
  assert res.passed and res.reward == 1.0 and res.final_answer == "412.5"
  assert res.turns == 2
  _check_invariants(res, fmt)
  # The sampled spans are exactly what the policy wrote, each ending in <|im_end|>.
  spans = _spans(res.loss_mask)
  assert len(spans) == 2
  for a, b in spans:
    assert res.tokens[b - 1] == fmt.sp.im_end
  assert set(res.timing) >= {"model", "tool", "world_start", "total", "harness"}


def _spans(mask):
  out, start = [], None
  for i, m in enumerate(list(mask) + [0]):
    if m and start is None:
      start = i
    if not m and start is not None:
      out.append((start, i))
      start = None
  return out


def test_tito_keeps_noncanonical_sampled_ids(fmt):
  """A sampled sequence whose decode-then-encode differs is kept id for id, with logprobs."""
  tok = fmt.tok
  # Spell a merged token of the vocabulary byte by byte: a valid sample, not canonical.
  word = next(t for t in (tok.id_to_token(i) for i in range(300, 1024))
              if len(tok.encode(tok.decode([tok.token_to_id(t)]))) == 1 and len(t) >= 5)
  text = tok.decode([tok.token_to_id(word)])
  bytewise = [tok.token_to_id(ch) for ch in word]
  assert tok.decode(bytewise) == text and tok.encode(text) != bytewise
  # And a UTF-8 character split into two byte tokens in the wrong order.
  e_acute = [tok.token_to_id(ch) for ch in "Ã©"]  # byte-level pieces of 0xC3 0xA9
  broken = e_acute[::-1]
  assert tok.encode(tok.decode(broken)) != broken
  answer_ids = tok.encode("412.5 ") + bytewise + broken

  class Sampler(harness_fakes.LookupOracle):
    def generate(self, prompt_ids, sampling, max_tokens, stop_ids):
      ids, lps, fin = super().generate(prompt_ids, sampling, max_tokens, stop_ids)
      if self.read(prompt_ids).results:  # the answer turn: non-canonical ids
        ids = tok.encode("done\n</think>\n\n") + answer_ids + [fmt.sp.im_end]
        lps = [-0.001 * (k + 1) - 1e-9 for k in range(len(ids))]
        self.sent = (ids, lps)
      return ids, lps, fin

  policy = Sampler(fmt)
  res = run_episode(_episode(), policy, fmt, SETTINGS)
  assert res.outcome == errors.OK, res.detail
  ids, lps = policy.sent
  start = _spans(res.loss_mask)[-1][0]
  assert res.tokens[start:start + len(ids)] == ids
  assert res.rollout_logprobs[start:start + len(ids)] == lps  # exact floats
  decoded = tok.decode(ids)
  assert tok.encode(decoded) != ids  # re-encoding would have trained on other tokens


@pytest.mark.parametrize("episode_temperature,expected", [(None, 1.0), (0.0, 0.0), (0.5, 0.5)])
def test_episode_temperature_overrides_the_loops(fmt, episode_temperature, expected):
  """The held-out eval samples at its own temperature (greedy at 0); None keeps the loop's."""
  seen = []

  class Recorder(harness_fakes.LookupOracle):
    def generate(self, prompt_ids, sampling, max_tokens, stop_ids):
      seen.append(sampling.temperature)
      return super().generate(prompt_ids, sampling, max_tokens, stop_ids)

  res = run_episode(_episode(temperature=episode_temperature), Recorder(fmt), fmt, SETTINGS)
  assert res.outcome == errors.OK, res.detail
  assert seen == [expected, expected]


def test_repair_then_success(fmt):
  bad = Action(raw="<tool_call>\n<function=lookup>\n<parameter=key>\nalpha\n</tool_call>")
  good = Action(tool_calls=[{"name": "lookup", "arguments": {"key": "alpha"}}])
  task = harness_fakes.lookup_task("alpha")
  policy = harness_fakes.TaskScriptPolicy(fmt, {task: [bad, good, Action(content="412.5")]})
  res = run_episode(_episode(), policy, fmt, SETTINGS)
  assert res.outcome == errors.OK and res.passed, res.detail
  assert res.events == {"bad_tool_call": 1, "repair": 1}
  assert "could not be parsed" in fmt.tok.decode(res.tokens)


def _nudge_run(fmt, settings, sizes):
  """Turn i echoes sizes[i] characters; the answer comes after the last echo."""
  task = "Echo things, then answer."
  script = [Action(tool_calls=[{"name": "echo", "arguments": {"text": "y", "times": n}}])
            for n in sizes] + [Action(content="412.5")]
  return run_episode(_episode(task), harness_fakes.TaskScriptPolicy(fmt, {task: script}), fmt, settings)


def test_nudge_fires_at_the_configured_point_only(fmt):
  res = _nudge_run(fmt, SETTINGS, [1, 1, 1])
  assert res.outcome == errors.OK and "nudge" not in res.events  # plenty of context: no nudge
  # Find the echo size that crosses the threshold, from the observed growth.
  base = _nudge_run(fmt, dataclasses.replace(SETTINGS, nudge=False), [1])
  limit = SETTINGS.max_context * (1 - SETTINGS.nudge_fraction)
  sizes = [1, 1, int(limit - len(base.tokens)) + 40, 1, 1]
  s = dataclasses.replace(SETTINGS, max_turns=10)
  res = _nudge_run(fmt, s, sizes)
  assert res.outcome == errors.OK, res.detail
  assert res.events.get("nudge") == 1
  text = fmt.tok.decode(res.tokens)
  assert text.count("[Notice from the system]") == 1
  # It sits in the first tool result after which the context left is <= 20% of the maximum.
  at = res.meta["nudge_at_tokens"]
  assert s.max_context - at <= s.nudge_fraction * s.max_context
  pos = text.index("[Notice from the system]")
  assert "y" * sizes[2] in text[:pos] and text[pos:].count("<tool_response>") == 2
  # Repeated nudges when configured, none when off.
  res = _nudge_run(fmt, dataclasses.replace(s, nudge_once=False), sizes)
  assert res.events.get("nudge") == 3
  res = _nudge_run(fmt, dataclasses.replace(s, nudge=False), sizes)
  assert "nudge" not in res.events
  assert NUDGE_TEXT.split("{")[0] in NUDGE_TEXT


def test_context_overflow_is_reward_zero(fmt):
  res = _nudge_run(fmt, SETTINGS, [5000])
  assert res.outcome == errors.CONTEXT_OVERFLOW and res.reward == 0.0
  # A tool output that overflows is not appended: the trajectory still fits a training row.
  assert 0 < len(res.tokens) <= SETTINGS.max_context
  assert len(res.loss_mask) == len(res.tokens) == len(res.rollout_logprobs)


def _res(group, outcome, reward=1.0, n=5):
  return EpisodeResult(task_id="t", group_id=group, sample_index=0, outcome=outcome,
                       reward=reward, tokens=[3] * n, loss_mask=[0, 0, 1, 1, 0][:n],
                       rollout_logprobs=[0, 0, -0.5, -0.25, 0][:n], prompt_len=2, turns=1)


def test_group_masking_rules():
  rs = [_res(0, errors.OK), _res(0, errors.WORLD_CRASH),                  # infra error: group out
        _res(1, errors.OK), _res(1, errors.TOOL_TIMEOUT),                 # one timeout: only it
        _res(2, errors.TOOL_TIMEOUT), _res(2, errors.EPISODE_TIMEOUT),
        _res(2, errors.OK),                                               # two: group out
        _res(3, errors.CONTEXT_OVERFLOW), _res(3, errors.MAX_TURNS), _res(3, errors.BAD_TOOL_CALL)]
  mask = group_train_mask(rs, max_timeouts_per_group=1)
  assert mask.tolist() == [False, False, True, False, False, False, False, True, True, True]
  batch = collate(rs, 1, pad_to=8, pad_id=0)
  assert batch["tokens"].shape == (10, 8) and batch["tokens"][0, 5:].tolist() == [0, 0, 0]
  assert batch["loss_mask"][0].sum() == 0 and batch["loss_mask"][2].tolist()[:5] == [0, 0, 1, 1, 0]
  assert batch["rewards"][7] == 0.0 and batch["rewards"][8] == 1.0
  assert batch["rollout_logprobs"][2, 2] == np.float32(-0.5)
  assert batch["group_ids"].tolist() == [0, 0, 1, 1, 2, 2, 2, 3, 3, 3]
  assert [errors.OUTCOMES[i] for i in batch["outcome_ids"]][:2] == [errors.OK, errors.WORLD_CRASH]
  with pytest.raises(ValueError, match="row length"):
    collate(rs, 1, pad_to=4)
  m = batch_metrics(rs, 1)
  assert m["outcome/tool_timeout"] == 2 and m["errors/world_crash"] == 1
  assert set(f"errors/{c}" for c in errors.ERROR_CLASSES) <= set(m)


def test_batch_metrics_report_mean_seconds_per_episode_by_kind():
  a, b = _res(0, errors.OK), _res(0, errors.OK)
  a.timing = {"model": 2.0, "tool": 1.0, "total": 3.5, "harness": 0.5}
  b.timing = {"model": 4.0, "world_start": 2.0, "total": 6.5, "harness": 0.5}
  m = batch_metrics([a, b])
  assert m["episode_s/model"] == 3.0 and m["episode_s/tool"] == 0.5
  assert m["episode_s/world_start"] == 1.0 and m["episode_s/total"] == 5.0
