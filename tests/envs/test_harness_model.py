"""The harness against the tiny random Qwen3.5 model (in-process reference decode).

Slow: every agent-loop process imports JAX and compiles prefill and decode.
"""
import pytest

from configs import tiny_cpu
from envs.harness import errors
from tests.envs import harness_fakes
from envs.harness.local_model import local_model_factory
from envs.harness.pool import AgentPool
from envs.harness.world import Episode


@pytest.mark.slow
def test_tiny_random_model_episodes_end_classified():
  c = tiny_cpu.get_config()
  c.train.max_context = 2048
  c.harness.max_tokens_per_turn = 48
  c.harness.max_turns = 3
  c.harness.model_timeout_s = 300.0  # the first call compiles
  c.harness.episode_timeout_s = 600.0
  eps = [Episode(task_id=f"m{i}", prompt=harness_fakes.lookup_task("alpha"),
                 world=harness_fakes.FakeWorldSpec(facts=(("alpha", "1"),), answer="1"), group_id=0,
                 sample_index=i, seed=i) for i in range(4)]
  with AgentPool.from_config(c, local_model_factory(c), 1) as pool:
    results = pool.run(eps)
  for r in results:
    assert r.outcome in errors.MODEL_OUTCOMES, (r.outcome, r.detail)
    assert len(r.tokens) == len(r.loss_mask) == len(r.rollout_logprobs)
    sampled = [lp for lp, m in zip(r.rollout_logprobs, r.loss_mask) if m]
    assert sampled and all(lp < 0 for lp in sampled)  # temperature 1 over 1024 ids
