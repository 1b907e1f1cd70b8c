"""Advantage estimators, the zero-variance filter and group masking."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from rl import advantages as adv_lib


def _cfg(**kw):
  c = base.get_config().rl
  with c.unlocked():
    for k, v in kw.items():
      c[k] = v
  return c


def _numpy_group_adv(rewards, groups, valid, kind, norm_by_std=False, eps=1e-6):
  out = np.zeros_like(rewards, dtype=np.float64)
  for g in np.unique(groups):
    rows = (groups == g) & valid
    r = rewards[rows].astype(np.float64)
    if len(r) < 2:
      continue
    if kind == "grpo":
      a = r - r.mean()
      if norm_by_std:
        a = a / (r.std(ddof=1) + eps)
    else:  # rloo: mean of the others
      a = np.array([r[i] - np.delete(r, i).mean() for i in range(len(r))])
    out[rows] = a
  return out


def test_registry():
  assert {"grpo", "rloo"} <= set(adv_lib.available_advantage_estimators())
  with pytest.raises(ValueError, match="unknown advantage estimator"):
    adv_lib.get_advantage_estimator("nope")


def test_grpo_hand_made():
  rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
  groups = jnp.array([7, 7, 7, 7, 2, 2])
  valid = jnp.ones(6, bool)
  got = adv_lib.grpo_advantages(rewards, groups, valid, _cfg())
  np.testing.assert_allclose(np.asarray(got), [0.5, -0.5, -0.5, 0.5, 0.0, 0.0], atol=1e-7)
  got = adv_lib.grpo_advantages(rewards, groups, valid, _cfg(grpo_norm_by_std=True))
  std = np.std([1, 0, 0, 1], ddof=1)
  np.testing.assert_allclose(np.asarray(got)[:4], np.array([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6),
                             rtol=1e-6)


def test_rloo_hand_made():
  rewards = jnp.array([1.0, 0.0, 0.0])
  got = adv_lib.rloo_advantages(rewards, jnp.zeros(3, jnp.int32), jnp.ones(3, bool), _cfg())
  np.testing.assert_allclose(np.asarray(got), [1.0, -0.5, -0.5], atol=1e-6)


@pytest.mark.parametrize("kind,norm", [("grpo", False), ("grpo", True), ("rloo", False)])
def test_random_against_numpy(kind, norm):
  rng = np.random.default_rng(1)
  rewards = rng.normal(size=24).astype(np.float32)
  groups = rng.permutation(np.repeat([11, 4, 30, 2, 8, 5], 4)).astype(np.int32)
  valid = rng.random(24) > 0.2
  cfg = _cfg(grpo_norm_by_std=norm)
  fn = adv_lib.get_advantage_estimator(kind)
  got = jax.jit(lambda r, g, v: fn(r, g, v, cfg))(
      jnp.asarray(rewards), jnp.asarray(groups), jnp.asarray(valid))
  want = _numpy_group_adv(rewards, groups, valid, kind, norm)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_invalid_samples_excluded_from_stats():
  rewards = jnp.array([1.0, 0.0, 100.0])
  valid = jnp.array([True, True, False])
  got = adv_lib.grpo_advantages(rewards, jnp.zeros(3, jnp.int32), valid, _cfg())
  np.testing.assert_allclose(np.asarray(got), [0.5, -0.5, 0.0])


def test_zero_variance_filter():
  rewards = jnp.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
  groups = jnp.array([0, 0, 1, 1, 2, 2])
  zv = adv_lib.zero_variance_mask(rewards, groups, jnp.ones(6, bool))
  np.testing.assert_array_equal(np.asarray(zv), [1, 1, 0, 0, 1, 1])
  adv, valid, metrics = adv_lib.compute_advantages(rewards, groups, jnp.ones(6, bool), _cfg())
  np.testing.assert_array_equal(np.asarray(valid), [0, 0, 1, 1, 0, 0])
  np.testing.assert_allclose(np.asarray(adv), [0, 0, -0.5, 0.5, 0, 0])
  np.testing.assert_allclose(float(metrics["adv/zero_variance_frac"]), 4 / 6)
  _, valid, _ = adv_lib.compute_advantages(rewards, groups, jnp.ones(6, bool),
                                           _cfg(filter_zero_variance=False))
  assert bool(valid.all())


def test_mask_groups_with_reasons():
  groups = np.array([0, 0, 1, 1, 2, 2])
  valid, reasons = adv_lib.mask_groups(groups, {1: "env_error", 2: "timeouts", 9: "absent"})
  np.testing.assert_array_equal(valid, [1, 1, 0, 0, 0, 0])
  assert reasons == {"env_error": 2, "timeouts": 2}
  # Already-invalid samples are not counted twice.
  valid, reasons = adv_lib.mask_groups(groups, {0: "x"}, valid=[False, True, True, True, True, True])
  assert reasons == {"x": 1}
