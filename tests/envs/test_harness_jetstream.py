"""The harness against the JetStream rollout server (tiny random model), token-in/token-out.

Slow: the server compiles its engine. Agent-loop processes reach it through the token client
(envs/harness/jetstream_client.py), as in `--mode=eval --config.policy=model
--config.harness.policy_backend=jetstream`.
"""
import pytest

from configs import tiny_cpu
from envs.harness import errors
from tests.envs import harness_fakes
from envs.harness.collate import batch_metrics
from envs.harness.jetstream_client import jetstream_policy_factory
from envs.harness.pool import AgentPool
from envs.harness.world import Episode
from rl.rollout import serve


@pytest.mark.slow
def test_episodes_through_the_rollout_server_end_classified():
  c = tiny_cpu.get_config()
  c.rollout.slots = 4
  c.rollout.max_len = 2048
  c.rollout.prefill_buckets = (1024, 2048)
  c.train.max_context = 2048
  c.harness.max_tokens_per_turn = 32
  c.harness.max_turns = 3
  c.harness.model_timeout_s = 600.0   # the first calls compile
  c.harness.episode_timeout_s = 1200.0
  server = serve.build_server(c, port=0, warmup=False)
  try:
    c.rollout.address = server.address
    eps = [Episode(task_id=f"j{i}", prompt=harness_fakes.lookup_task("alpha"),
                   world=harness_fakes.FakeWorldSpec(facts=(("alpha", "1"),), answer="1"),
                   group_id=i // 2, sample_index=i % 2, seed=i) for i in range(4)]
    with AgentPool.from_config(c, jetstream_policy_factory(c), 2) as pool:
      results = pool.run(eps)
  finally:
    server.stop()
  m = batch_metrics(results)
  for r in results:
    assert r.outcome in errors.MODEL_OUTCOMES, (r.outcome, r.detail)
    sampled = [(t, lp) for t, lp, k in zip(r.tokens, r.rollout_logprobs, r.loss_mask) if k]
    assert sampled and all(lp <= 0 for _, lp in sampled)
    assert all(0 <= t < c.model.vocab_size for t, _ in sampled)
  assert m["episodes"] == 4
