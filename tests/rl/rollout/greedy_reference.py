"""The reference the served greedy tokens are compared with: the model's full forward pass
recomputed over the whole sequence for every new token; and a served tiny random model."""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from configs import base
from configs import tiny_cpu
from envs.harness.jetstream_client import TokenClient
from models import qwen3_5
from models import sharding
from rl.rollout import serve
from rl.rollout.engine import QwenEngine


@functools.cache
def _forward(cfg):
  return jax.jit(functools.partial(qwen3_5.forward, cfg))


def greedy_by_recompute(cfg, params, prompt, n: int, max_len: int) -> list:
  """`n` greedy tokens after `prompt`, each from a forward pass over [1, max_len] tokens (one
  compile per cfg and max_len)."""
  ids = list(prompt)
  for _ in range(n):
    tokens = np.zeros((1, max_len), np.int32)
    tokens[0, :len(ids)] = ids
    ids.append(int(jnp.argmax(_forward(cfg)(params, jnp.asarray(tokens))[0, len(ids) - 1])))
  return ids[len(prompt):]


@contextlib.contextmanager
def tiny_server(max_len: int, prefill_buckets=(192,), **rollout):
  """A JetStream server (2 slots) of the tiny model at a wide random init, so that greedy
  tokens are far from ties and comparable across numerical paths, with `rollout` settings.
  Yields (server, TokenClient, model cfg, params)."""
  c = tiny_cpu.get_config()
  c.unlock()
  c.rollout.slots = 2
  c.rollout.max_len = max_len
  c.rollout.prefill_buckets = tuple(prefill_buckets)
  c.rollout.update(rollout)
  c.model.initializer_range = 0.2
  cfg = qwen3_5.config_from_dict(c.model)
  params = qwen3_5.init_params(cfg, jax.random.key(c.seed))
  s = serve.build_server(c, params=params, port=0, warmup=False)
  client = TokenClient(s.address, timeout_s=120)
  try:
    yield s, client, cfg, params
  finally:
    client.close()
    s.stop()


def one_device_and_sharded_engines(max_len: int, bucket: int, **sharded_kw):
  """Two engines on the same random weights: one on one device, one on a (1, 2, 2, 2) mesh with
  `sharded_kw` (cache settings), both with one prefill bucket."""
  c = base.get_config()
  with c.mesh.unlocked():
    c.mesh.shape = (1, 2, 2, 2)
  cfg = qwen3_5.config_from_dict(base.get_model_config())
  params = qwen3_5.init_params(cfg, jax.random.key(1))
  kw = dict(slots=2, max_len=max_len, prefill_buckets=(bucket,), params=params)
  return QwenEngine(cfg, **kw), QwenEngine(cfg, mesh=sharding.make_mesh(c.mesh),
                                           rules=sharding.rules_from_config(c.mesh.rules),
                                           **sharded_kw, **kw)
