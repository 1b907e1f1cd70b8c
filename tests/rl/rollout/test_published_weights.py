"""Weight sync across jobs: a trainer publishes versions under a directory, a rollout server
watching it serves each one, exactly, over real gRPC and real orbax saves.

One server for the module (tiny model, 2 slots, 64-token context); each test has its own
weights directory, watcher and publisher.
"""
import functools
import os
import sys

import jax
import jax.numpy as jnp
import pytest

from configs import tiny_cpu
from envs.harness.jetstream_client import JetStreamPolicy
from envs.harness.jetstream_client import TokenClient
from envs.harness.policy import SamplingParams
from models import qwen3_5
from rl.rollout import serve
from rl.rollout.published_weights import UNLOADED
from rl.rollout.published_weights import WeightPublisher
from rl.rollout.published_weights import WeightSyncTimeout
from rl.rollout.published_weights import WeightWatcher

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from greedy_reference import greedy_by_recompute  # noqa: E402

MAX_LEN = 64
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 17, 300, 41, 900, 3]


@pytest.fixture(scope="module")
def config():
  c = tiny_cpu.get_config()
  c.unlock()
  c.rollout.slots = 2
  c.rollout.max_len = MAX_LEN
  c.rollout.prefill_buckets = (16,)
  c.rollout.prefix_cache = False
  c.model.initializer_range = 0.2   # logits far from ties: greedy is comparable across paths
  return c


@pytest.fixture(scope="module")
def cfg(config):
  return qwen3_5.config_from_dict(config.model)


@functools.cache
def _params(cfg, seed):
  return qwen3_5.init_params(cfg, jax.random.key(seed))


@pytest.fixture(scope="module")
def server(config, cfg):
  s = serve.build_server(config, params=_params(cfg, 7), port=0, warmup=False,
                         initial_version=UNLOADED)
  client = TokenClient(s.address, timeout_s=120)
  yield s, client
  client.close()
  s.stop()


@pytest.fixture
def sync(server, tmp_path):
  s, _ = server
  watcher = WeightWatcher(str(tmp_path / "weights"), s.engine, poll_s=0.05).start()
  publisher = WeightPublisher(str(tmp_path / "weights"), [s.address], timeout_s=120, poll_s=0.05)
  yield watcher, publisher
  publisher.stop()
  watcher.stop()


def _greedy_by_recompute(cfg, params, prompt, n):
  return greedy_by_recompute(cfg, params, prompt, n, MAX_LEN)


def _served(client):
  out = client.generate(PROMPT, GREEDY, max_tokens=6, stop_ids=[])
  return out.ids, out.weights_version


def test_each_published_version_is_served_exactly_and_reported(server, sync, cfg):
  _, client = server
  _, publisher = sync
  a, b = _params(cfg, 0), _params(cfg, 1)
  want_a, want_b = (_greedy_by_recompute(cfg, p, PROMPT, 6) for p in (a, b))
  assert want_a != want_b
  for version, params, want in ((0, a, want_a), (1, b, want_b), (2, a, want_a)):
    assert publisher.update_weights(params, version) == version
    assert publisher.served_versions() == {server[0].address: version}
    assert _served(client) == (want, version)


def test_a_resumed_trainer_takes_the_servers_back_to_its_step(server, sync, cfg):
  """Versions above the resumed step (published before a crash) are removed; the newest
  version wins even when it is older than the one served."""
  _, client = server
  watcher, publisher = sync
  a, b = _params(cfg, 0), _params(cfg, 1)
  publisher.update_weights(a, 3)
  publisher.update_weights(b, 4)
  assert watcher.loaded == 4
  publisher.update_weights(a, 3)   # resumed from step 3's checkpoint
  assert publisher._ckpt.all_steps() == [3]
  assert _served(client) == (_greedy_by_recompute(cfg, a, PROMPT, 6), 3)
  # A run starting afresh on this directory would be answered by these versions.
  with pytest.raises(ValueError, match="holds weights versions \\[3\\] of an earlier run"):
    publisher.require_empty()


def test_a_version_the_server_cannot_load_is_a_timeout_naming_the_server(server, sync, config,
                                                                          cfg):
  _, client = server
  watcher, publisher = sync
  publisher.update_weights(_params(cfg, 0), 1)
  wrong_cfg = qwen3_5.config_from_dict(dict(config.model.to_dict(), hidden_size=32))
  publisher.timeout_s = 2.0
  with pytest.raises(WeightSyncTimeout, match=f"{server[0].address} serves version 1"):
    publisher.update_weights(qwen3_5.init_params(wrong_cfg, jax.random.key(0)), 2)
  assert 2 in watcher.failed
  # The server goes on serving the last version it could load.
  assert _served(client) == (_greedy_by_recompute(cfg, _params(cfg, 0), PROMPT, 6), 1)


def test_float32_masters_published_to_a_bfloat16_server_are_served_cast(config, cfg, tmp_path):
  """The trainer publishes its float32 params; a server with rollout.weights_dtype = bfloat16
  restores them cast and serves the model's tokens with the cast weights."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.rollout.weights_dtype = "bfloat16"
  s = serve.build_server(c, params=_params(cfg, 7), port=0, warmup=False,
                         initial_version=UNLOADED)
  client = TokenClient(s.address, timeout_s=120)
  watcher = WeightWatcher(str(tmp_path / "weights"), s.engine, poll_s=0.05).start()
  publisher = WeightPublisher(str(tmp_path / "weights"), [s.address], timeout_s=120, poll_s=0.05)
  try:
    masters = _params(cfg, 0)
    publisher.update_weights(masters, 0)
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim >= 2 else x, masters)
    assert _served(client) == (_greedy_by_recompute(cfg, cast, PROMPT, 6), 0)
    assert s.engine.load_params().get()[0]["embed"].dtype == jnp.bfloat16
  finally:
    publisher.stop()
    watcher.stop()
    client.close()
    s.stop()


def test_servers_without_a_weights_dir_is_a_clear_error():
  with pytest.raises(ValueError, match="rollout.weights_dir"):
    WeightPublisher("", ["localhost:1"])


def test_a_policy_over_two_servers_sends_requests_to_each_in_turn(config, cfg):
  servers = [serve.build_server(config, params=_params(cfg, seed), port=0, warmup=False)
             for seed in (0, 1)]
  clients = [TokenClient(s.address, timeout_s=120) for s in servers]
  try:
    policy = JetStreamPolicy(*clients)
    got = [policy.generate(PROMPT, GREEDY, 6, [])[0] for _ in range(4)]
    want = [_greedy_by_recompute(cfg, _params(cfg, seed), PROMPT, 6) for seed in (0, 1)]
    assert want[0] != want[1]
    assert got == want + want
  finally:
    for c in clients:
      c.close()
    for s in servers:
      s.stop()
