"""The reference the served greedy tokens are compared with: the model's full forward pass
recomputed over the whole sequence for every new token."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import qwen3_5


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
