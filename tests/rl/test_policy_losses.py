"""Every policy loss against a direct numpy transcription, incl. masked and clipped regions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from rl import policy_losses


def _cfg(**kw):
  c = base.get_config().rl
  c.update_from_flattened_dict(kw)
  return c


def _inputs(seed=0, b=4, t=16, spread=0.8):
  """Logprobs spread widely so that every clipped / masked region is populated."""
  rng = np.random.default_rng(seed)
  roll = np.log(rng.uniform(0.05, 0.95, size=(b, t))).astype(np.float32)
  old = (roll + rng.normal(0, 0.05, size=(b, t))).astype(np.float32)
  old = np.minimum(old, -1e-3)
  lp = (old + rng.normal(0, spread, size=(b, t))).astype(np.float32)
  lp = np.minimum(lp, -1e-3)
  adv = np.repeat(rng.choice([-1.5, -0.5, 0.5, 1.0], size=(b, 1)), t, axis=1).astype(np.float32)
  adv[0, :t // 2] *= -1                                          # mixed signs inside a row
  mask = (rng.random((b, t)) > 0.2).astype(np.float32)
  return dict(lp=lp, old=old, roll=roll, adv=adv, mask=mask)


def _pi(d):
  return policy_losses.PolicyInputs(jnp.asarray(d["lp"]), jnp.asarray(d["old"]),
                                    jnp.asarray(d["roll"]), jnp.asarray(d["adv"]),
                                    jnp.asarray(d["mask"]))


def _loss_and_grad(name, d, cfg):
  """Token loss and d(sum of masked loss)/d(logprobs) [batch, seq]."""
  fn = policy_losses.get_policy_loss(name)

  def total(lp):
    x = _pi(d)
    x = policy_losses.PolicyInputs(lp, x.old_logprobs, x.rollout_logprobs, x.advantages,
                                   x.loss_mask)
    loss, metrics = fn(x, cfg)
    return jnp.sum(loss * x.loss_mask), (loss, metrics)

  (_, (loss, metrics)), g = jax.value_and_grad(total, has_aux=True)(jnp.asarray(d["lp"]))
  return np.asarray(loss), {k: np.asarray(v) for k, v in metrics.items()}, np.asarray(g)


def test_registry():
  assert ({"ppo", "gspo", "rollout_is", "dppo_binary_tv"}
          <= set(policy_losses.available_policy_losses()))
  with pytest.raises(ValueError, match="unknown policy loss"):
    policy_losses.get_policy_loss("nope")


@pytest.mark.parametrize("dual_c", [0.0, 3.0])
def test_ppo_clip_higher_and_dual_clip(dual_c):
  d = _inputs(0)
  cfg = _cfg(**{"ppo.eps_low": 0.2, "ppo.eps_high": 0.28, "ppo.dual_clip_c": dual_c})
  loss, metrics, grad = _loss_and_grad("ppo", d, cfg)
  r = np.exp(d["lp"] - d["old"])
  a = d["adv"]
  s1, s2 = r * a, np.clip(r, 0.8, 1.28) * a
  want = -np.minimum(s1, s2)
  clipped = s2 < s1
  # d/dlp of -r*A is -r*A where the unclipped branch is active, else 0.
  want_grad = np.where(clipped, 0.0, -r * a)
  if dual_c:
    dual = (a < 0) & (-dual_c * a < want)
    want = np.where(dual, -dual_c * a, want)
    want_grad = np.where(dual, 0.0, want_grad)
    assert dual.any()
    np.testing.assert_array_equal(metrics["dual_clip_frac"], dual.astype(np.float32))
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad * d["mask"], rtol=1e-5, atol=1e-6)
  assert clipped.any() and (~clipped).any()
  np.testing.assert_array_equal(metrics["clip_frac"], clipped.astype(np.float32))
  np.testing.assert_array_equal(metrics["clip_frac_low"], (clipped & (r < 0.8)).astype(np.float32))
  np.testing.assert_array_equal(metrics["clip_frac_high"], (clipped & (r > 1.28)).astype(np.float32))
  assert (clipped & (r < 0.8)).any() and (clipped & (r > 1.28)).any()


def test_gspo_sequence_ratio():
  d = _inputs(1, spread=0.3)
  cfg = _cfg(**{"gspo.eps_low": 0.05, "gspo.eps_high": 0.08})
  loss, metrics, grad = _loss_and_grad("gspo", d, cfg)
  m = d["mask"]
  s = np.exp(((d["lp"] - d["old"]) * m).sum(1, keepdims=True) / m.sum(1, keepdims=True))
  s = np.broadcast_to(s, d["lp"].shape)
  a = d["adv"]
  s1, s2 = s * a, np.clip(s, 0.95, 1.08) * a
  want = -np.minimum(s1, s2)
  clipped = s2 < s1
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  # Token-form gradient: d s_it / d lp_t = s_i (sg on the sequence ratio).
  np.testing.assert_allclose(grad, np.where(clipped, 0.0, -s * a) * m, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(metrics["clip_frac"], clipped.astype(np.float32))
  assert clipped.any() and (~clipped).any()


def test_rollout_is_band():
  d = _inputs(2, b=8, t=32, spread=2.0)
  cfg = _cfg(**{"rollout_is.eps_low": 0.5, "rollout_is.eps_high": 4.0})
  loss, metrics, grad = _loss_and_grad("rollout_is", d, cfg)
  r = np.exp(d["lp"] - d["roll"])
  band = (r > 0.5) & (r < 5.0)
  w = np.where(band, r, 0.0)
  np.testing.assert_allclose(loss, -w * d["adv"] * d["lp"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, -w * d["adv"] * d["mask"], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(metrics["clip_frac"], (~band).astype(np.float32))
  assert (r <= 0.5).any() and (r >= 5.0).any() and band.any()


def test_dppo_binary_tv():
  d = _inputs(3, spread=0.9)
  cfg = _cfg(**{"dppo.delta_low": 0.15, "dppo.delta_high": 0.15})
  loss, metrics, grad = _loss_and_grad("dppo_binary_tv", d, cfg)
  p, pb = np.exp(d["lp"]), np.exp(d["roll"])
  a = d["adv"]
  keep = np.where(a > 0, p - pb <= 0.15, p - pb >= -0.15)
  r = np.exp(d["lp"] - d["old"])
  np.testing.assert_allclose(loss, -r * a * keep, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, -r * a * keep * d["mask"], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(metrics["clip_frac"], (~keep).astype(np.float32))
  # Each masked region is populated, and moves against the advantage are never masked.
  assert ((a > 0) & (p - pb > 0.15)).any() and ((a < 0) & (p - pb < -0.15)).any()
  assert ((a > 0) & (p - pb < -0.15) & keep).any() and ((a < 0) & (p - pb > 0.15) & keep).any()


def test_dppo_hand_cases():
  """Probabilities chosen by hand: (A, p_rollout, p) -> masked?"""
  cases = [(+1.0, 0.60, 0.90, True), (+1.0, 0.60, 0.30, False),
           (-1.0, 0.60, 0.30, True), (-1.0, 0.60, 0.90, False),
           (+1.0, 0.60, 0.70, False), (-1.0, 0.60, 0.50, False)]
  a = np.array([[c[0] for c in cases]], np.float32)
  pb = np.log(np.array([[c[1] for c in cases]], np.float32))
  p = np.log(np.array([[c[2] for c in cases]], np.float32))
  x = policy_losses.PolicyInputs(jnp.asarray(p), jnp.asarray(pb), jnp.asarray(pb),
                                 jnp.asarray(a), jnp.ones_like(jnp.asarray(a)))
  _, metrics = policy_losses.dppo_binary_tv_loss(x, _cfg())
  np.testing.assert_array_equal(metrics["clip_frac"][0], [float(c[3]) for c in cases])


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_truncated_importance_sampling(mode):
  d = _inputs(4, b=8)
  d["old"] = (d["roll"] + np.random.default_rng(5).normal(0, 0.5, d["roll"].shape)).astype(np.float32)
  cfg = _cfg(policy_loss="ppo", **{"tis.mode": mode, "tis.cap": 1.2})
  loss, metrics = policy_losses.compute_policy_loss(_pi(d), cfg)
  base_loss, _ = policy_losses.ppo_clip_loss(_pi(d), cfg)
  if mode == "token":
    w = np.minimum(np.exp(d["old"] - d["roll"]), 1.2)
  else:
    w = np.minimum(np.exp(((d["old"] - d["roll"]) * d["mask"]).sum(1, keepdims=True)), 1.2)
    w = np.broadcast_to(w, d["old"].shape)
  assert (w == np.float32(1.2)).any() and (w < 1.2).any()
  np.testing.assert_allclose(np.asarray(loss), np.asarray(base_loss) * w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(metrics["policy/tis_weight"]), w, rtol=1e-5)


@pytest.mark.parametrize("est", ["k1", "k3"])
def test_kl_penalty(est):
  d = _inputs(6)
  ref = (d["lp"] + np.random.default_rng(7).normal(0, 0.3, d["lp"].shape)).astype(np.float32)
  cfg = _cfg(policy_loss="ppo", **{"kl.coef": 0.1, "kl.estimator": est})
  loss, metrics = policy_losses.compute_policy_loss(_pi(d), cfg, ref_logprobs=jnp.asarray(ref))
  base_loss, _ = policy_losses.ppo_clip_loss(_pi(d), cfg)
  if est == "k1":
    kl = d["lp"] - ref
  else:
    kl = np.exp(ref - d["lp"]) - (ref - d["lp"]) - 1
    assert (kl >= 0).all()
  np.testing.assert_allclose(np.asarray(loss), np.asarray(base_loss) + 0.1 * kl, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(metrics["policy/kl_ref"]), kl, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="ref_logprobs"):
    policy_losses.compute_policy_loss(_pi(d), cfg)


def test_diagnostics():
  d = _inputs(8)
  ent = np.abs(np.random.default_rng(9).normal(size=d["lp"].shape)).astype(np.float32)
  _, metrics = policy_losses.compute_policy_loss(_pi(d), _cfg(), entropy=jnp.asarray(ent))
  r = np.exp(d["lp"] - d["old"])
  np.testing.assert_allclose(np.asarray(metrics["policy/approx_kl"]), r - 1 - np.log(r),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(metrics["policy/logprob_diff_vs_rollout"]),
                             d["lp"] - d["roll"], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(metrics["policy/entropy"]), ent)
  assert set(metrics) >= {"policy/clip_frac", "policy/pg_loss",
                          "policy/abs_logprob_diff_vs_rollout"}
