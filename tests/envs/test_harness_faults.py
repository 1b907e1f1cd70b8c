"""Fault injection through the process pool: one test per taxonomy class.

Each test runs a batch holding the fault and healthy episodes; the fault must be classified,
the batch must complete, and every healthy trajectory must come back intact.
"""
import dataclasses
import functools
import re

import pytest

from envs.harness import errors
from tests.envs import harness_fakes
from envs.harness.collate import batch_metrics
from envs.harness.agent_loop import LoopSettings
from envs.harness.policy import Action
from envs.harness.pool import AgentPool
from envs.harness.pool import FormatSpec
from envs.harness.pool import PoolInitError
from envs.harness.world import Episode

SETTINGS = LoopSettings(
    max_turns=8, max_context=3000, max_tokens_per_turn=200, repair_attempts=2, nudge=True,
    nudge_fraction=0.2, nudge_once=True, world_start_timeout_s=3.0, model_timeout_s=1.5,
    tool_timeout_s=1.0, grade_timeout_s=3.0, episode_timeout_s=4.0, temperature=1.0, top_p=1.0,
    top_k=0)
WORLD = harness_fakes.FakeWorldSpec(facts=(("alpha", "412.5"),), answer="412.5")


def _call(name, **args):
  return Action(tool_calls=[{"name": name, "arguments": args}])


BAD = Action(raw="<tool_call>\n<function=lookup>\n<parameter=key>\nalpha\n</function>\n</tool_call>")
SCRIPTS = {
    "hanging tool": [_call("hang", seconds=30)],
    "crashing tool": [_call("crash"), Action(content="412.5")],
    "world killed": [_call("lookup", key="alpha"), _call("die")],
    "engine hangs": harness_fakes.HANG_ENGINE,
    "engine raises": harness_fakes.ENGINE_RAISES,
    "malformed call": [BAD],
    "unknown tool": [_call("frobnicate", x=1)],
    "overflow": [_call("echo", text="z", times=20000)],
    "loops": [_call("lookup", key="alpha")],
    "slow tools": [_call("hang", seconds=0.8)],
    "agent dies": harness_fakes.KILL_AGENT,
    # Holds the GIL in a regex for minutes: only the parent's kill can end it.
    "wedged": [_call("lookup", key="alpha")],
}


class _WedgingPolicy(harness_fakes.TaskScriptPolicy):
  def generate(self, prompt_ids, sampling, max_tokens, stop_ids):
    if self.read(prompt_ids).task == "wedged":
      re.match(r"(a+)+$", "a" * 64 + "b")
    return super().generate(prompt_ids, sampling, max_tokens, stop_ids)


@pytest.fixture(scope="module")
def pool():
  factory = functools.partial(_WedgingPolicy, scripts=SCRIPTS)
  with AgentPool(2, FormatSpec(), factory, SETTINGS, kill_grace_s=1.0) as p:
    yield p


def _run(pool, fault, healthy=2, world=WORLD):
  eps = [Episode(task_id="fault", prompt=fault, world=world, group_id=0)]
  eps += [Episode(task_id=f"ok{i}", prompt=harness_fakes.lookup_task("alpha"), world=WORLD, group_id=1,
                  sample_index=i) for i in range(healthy)]
  results = pool.run(eps)
  assert len(results) == len(eps)
  for r in results[1:]:
    assert r.outcome == errors.OK and r.passed and r.reward == 1.0, (r.outcome, r.detail)
    assert len(r.tokens) == len(r.loss_mask) == len(r.rollout_logprobs) > r.prompt_len
  return results[0], batch_metrics(results, 1)


def test_tool_timeout(pool):
  r, m = _run(pool, "hanging tool")
  assert r.outcome == errors.TOOL_TIMEOUT and "tool hang" in r.detail
  assert m["errors/tool_timeout"] == 1


def test_tool_error(pool):
  r, m = _run(pool, "crashing tool")
  assert r.outcome == errors.OK and r.events[errors.TOOL_ERROR] == 1 and r.passed
  assert m["errors/tool_error"] == 1


def test_world_killed_mid_episode(pool):
  r, m = _run(pool, "world killed")
  assert r.outcome == errors.WORLD_CRASH and "die" in r.detail, r.detail
  assert r.turns == 2 and m["errors/world_crash"] == 1


def test_world_start_timeout(pool):
  r, _ = _run(pool, harness_fakes.lookup_task("alpha"),
              world=dataclasses.replace(WORLD, start_delay_s=10))
  assert r.outcome == errors.WORLD_CRASH and "world start" in r.detail and r.tainted


def test_engine_stops_answering(pool):
  before = pool.recycled
  r, m = _run(pool, "engine hangs")
  assert r.outcome == errors.ENGINE_ERROR and "did not return" in r.detail
  assert pool.recycled == before + 1 and m["errors/engine_error"] == 1
  r, _ = _run(pool, "engine raises")
  assert r.outcome == errors.ENGINE_ERROR and "unreachable" in r.detail


def test_malformed_tool_call(pool):
  r, m = _run(pool, "malformed call")
  assert r.outcome == errors.BAD_TOOL_CALL and "after 2 repair" in r.detail
  assert r.events == {"bad_tool_call": 3, "repair": 2}
  assert m["errors/bad_tool_call"] == 3 and m["outcome/bad_tool_call"] == 1


def test_unknown_tool(pool):
  r, m = _run(pool, "unknown tool")
  assert r.outcome == errors.UNKNOWN_TOOL and "frobnicate" in r.detail
  assert m["errors/unknown_tool"] == 3


def test_context_overflow(pool):
  r, _ = _run(pool, "overflow")
  assert r.outcome == errors.CONTEXT_OVERFLOW and r.reward == 0.0


def test_max_turns(pool):
  r, _ = _run(pool, "loops")
  assert r.outcome == errors.MAX_TURNS and r.turns == SETTINGS.max_turns


def test_episode_timeout(pool):
  r, _ = _run(pool, "slow tools")
  assert r.outcome == errors.EPISODE_TIMEOUT, (r.outcome, r.detail)
  assert 3 <= r.turns < SETTINGS.max_turns


def test_dead_agent_process_is_replaced(pool):
  pids = set(pool.pids)
  deaths = len(pool.deaths)
  r, m = _run(pool, "agent dies", healthy=3)
  assert r.outcome == errors.HARNESS_BUG and "exit code 3" in r.detail
  assert len(pool.deaths) == deaths + 1 and pool.size == 2 and set(pool.pids) != pids


@pytest.mark.slow
def test_wedged_process_is_killed_at_the_deadline(pool):
  r, _ = _run(pool, "wedged")
  assert r.outcome == errors.EPISODE_TIMEOUT and "killed" in r.detail


def test_bad_policy_factory_is_a_config_error():
  with pytest.raises(PoolInitError, match="ZeroDivisionError"):
    AgentPool(1, FormatSpec(), functools.partial(_broken_factory), SETTINGS)


def _broken_factory(fmt):
  return 1 / 0


def test_random_policy_episodes_end_classified():
  """Garbage in (uniform random ids, control ids included): every episode still ends with a
  named outcome, and the trajectory accounting holds."""
  s = dataclasses.replace(SETTINGS, max_tokens_per_turn=64, episode_timeout_s=20.0)
  factory = functools.partial(harness_fakes.UniformRandomPolicy, stop_bias=0.05)
  eps = [Episode(task_id=f"r{i}", prompt=harness_fakes.lookup_task("alpha"), world=WORLD, group_id=i // 4,
                 sample_index=i % 4, seed=i) for i in range(12)]
  with AgentPool(2, FormatSpec(), factory, s, kill_grace_s=2.0) as p:
    results = p.run(eps)
  outcomes = {r.outcome for r in results}
  assert outcomes <= set(errors.MODEL_OUTCOMES), [(r.outcome, r.detail) for r in results]
  for r in results:
    assert len(r.tokens) == len(r.loss_mask) == len(r.rollout_logprobs)
    assert sum(r.loss_mask) > 0 and not any(r.loss_mask[:r.prompt_len])


def test_world_start_gate_serialises_starts():
  """With one start slot, starts queue (counted as start_queue time), none times out."""
  slow = dataclasses.replace(WORLD, start_delay_s=0.5)
  eps = [Episode(task_id=f"g{i}", prompt=harness_fakes.lookup_task("alpha"), world=slow, group_id=i)
         for i in range(4)]
  factory = functools.partial(harness_fakes.TaskScriptPolicy, scripts={})
  with AgentPool(4, FormatSpec(), factory, SETTINGS, kill_grace_s=1.0, max_world_starts=1) as p:
    results = p.run(eps)
  assert all(r.outcome == errors.OK for r in results), [(r.outcome, r.detail) for r in results]
  waits = sorted(r.timing["start_queue"] for r in results)
  assert waits[-1] >= 1.0  # the last one waited for (about) three starts before it


def test_on_result_sees_every_result_as_it_arrives(pool):
  eps = [Episode(task_id="fault", prompt="agent dies", world=WORLD, group_id=0)]
  eps += [Episode(task_id=f"ok{i}", prompt=harness_fakes.lookup_task("alpha"), world=WORLD, group_id=1,
                  sample_index=i) for i in range(3)]
  seen = []
  results = pool.run(eps, on_result=seen.append)
  assert sorted(r.task_id for r in seen) == sorted(r.task_id for r in results)
  assert {r.outcome for r in seen} == {errors.OK, errors.HARNESS_BUG}
