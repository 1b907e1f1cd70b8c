"""benchmarks/grad_noise.py: the noise-scale estimator and the per-group gradient split."""
import os
import sys

import jax
from jax.flatten_util import ravel_pytree
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests", "rl"))

import grad_noise  # noqa: E402
import train_utils  # noqa: E402
from models import sharding  # noqa: E402
from rl.train_step import TrainStep  # noqa: E402


def _draws(b_noise, n=300, dim=2000, seed=0):
  """n per-group gradients around a fixed expected gradient with noise trace b_noise |G|^2."""
  rng = np.random.default_rng(seed)
  g = rng.normal(size=dim)
  sigma = np.sqrt(b_noise * (g @ g) / dim)
  return g + rng.normal(size=(n, dim)) * sigma


def test_noise_scale_recovers_a_known_noise_scale():
  for b in (2.0, 30.0):
    r = grad_noise.noise_scale(_draws(b), resamples=200)
    assert abs(r["b_noise"] / b - 1) < 0.2, r
    assert r["b_noise_lo95"] <= r["b_noise"]


def test_pure_noise_gives_no_direction_and_a_large_lower_bound():
  rng = np.random.default_rng(1)
  r = grad_noise.noise_scale(rng.normal(size=(20, 2000)), resamples=500)
  assert abs(r["half_cos"]) < 0.1
  assert r["b_noise_lo95"] > 20          # at least the groups measured


@pytest.mark.slow   # a train step per group (~30 s); `make test-all`, CI
def test_per_group_gradients_sum_to_the_batch_gradient():
  c = train_utils.small_config(**{"train.prompts_per_step": 3})
  c.mesh.shape = (1, 1, 1, 1)             # a group's 4 rows on one device
  step_fn = TrainStep(c, sharding.make_mesh(c.mesh, devices=jax.devices()[:1]))
  params = step_fn.init_state(jax.random.key(0))["params"]
  batch = train_utils.make_batch(c, params)
  g, groups = grad_noise.per_group_grads(step_fn, params, batch)
  assert len(groups) == 3 and g.shape[0] == 3
  with sharding.use_mesh(step_fn.mesh, step_fn.rules):
    prepared, _ = step_fn.prepare(params, batch)
    whole = step_fn.loss_and_grads(params, step_fn.add_weights(prepared))[1]
  whole = np.asarray(ravel_pytree(whole)[0], np.float64)
  np.testing.assert_allclose(g.sum(0), whole, rtol=1e-4, atol=1e-7)
  assert np.linalg.norm(g[0] - whole) > 1e-3 * np.linalg.norm(whole)   # the split is real
