"""Per-token policy losses, chosen by config string, plus TIS, KL penalty and diagnostics.

Every registered loss has the signature

  loss_fn(inputs: PolicyInputs, cfg) -> (token_loss [batch, seq], metrics)

where `metrics` maps a name to a per-token float array [batch, seq] (e.g. a 0/1 "this token
was clipped" indicator). Nothing is reduced here: the caller reduces the loss with the
configured loss reduction (rl/reductions.py) and the metrics with a token mean over the WHOLE
mini-batch, so both are exact under micro-batching and data parallelism.

Conventions (SkyRL / verl): `logprobs` are the current policy's (differentiable),
`old_logprobs` those of the policy that the PPO ratio is taken against (the rollout logprobs
unless the step recomputes them), `rollout_logprobs` those the inference engine reported
when sampling. `advantages` are per token ([batch, seq]; a per-sample advantage broadcast).
Log-ratios are clamped to [-20, 20] before `exp` for stability.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections

from rl import registry

_LOG_RATIO_CLAMP = 20.0


@dataclasses.dataclass(frozen=True)
class PolicyInputs:
  """Token-aligned arrays, all [batch, seq]."""
  logprobs: jax.Array
  old_logprobs: jax.Array
  rollout_logprobs: jax.Array
  advantages: jax.Array
  loss_mask: jax.Array


PolicyLossFn = Callable[[PolicyInputs, ml_collections.ConfigDict],
                        tuple[jax.Array, dict[str, jax.Array]]]

_LOSSES: registry.Registry[PolicyLossFn] = registry.Registry("policy loss")
register_policy_loss = _LOSSES.register
get_policy_loss = _LOSSES.get
available_policy_losses = _LOSSES.names


def _ratio(logp, ref_logp):
  return jnp.exp(jnp.clip(logp - ref_logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _f(x):
  return x.astype(jnp.float32)


@register_policy_loss("ppo")
def ppo_clip_loss(x: PolicyInputs, cfg):
  """PPO clipped surrogate with clip-higher and optional dual clip.

  r = pi/pi_old;  l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A).
  Dual clip (cfg.ppo.dual_clip_c > 1, 0 = off): for A < 0, l = min(l, -c A), which bounds
  the loss of tokens whose ratio has grown far above 1 on a negative advantage.
  """
  eps_low, eps_high, c = cfg.ppo.eps_low, cfg.ppo.eps_high, cfg.ppo.dual_clip_c
  adv = x.advantages
  ratio = _ratio(x.logprobs, x.old_logprobs)
  surr1 = ratio * adv
  surr2 = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
  loss = -jnp.minimum(surr1, surr2)
  clipped = surr2 < surr1
  metrics = {
      "clip_frac": _f(clipped),
      "clip_frac_low": _f(clipped & (ratio < 1.0 - eps_low)),
      "clip_frac_high": _f(clipped & (ratio > 1.0 + eps_high)),
  }
  if c:
    if c <= 1.0:
      raise ValueError(f"rl.ppo.dual_clip_c must be > 1 (or 0 = off), got {c}")
    dual = -c * adv
    use_dual = (adv < 0) & (dual < loss)
    loss = jnp.where(use_dual, dual, loss)
    metrics["dual_clip_frac"] = _f(use_dual)
  return loss, metrics


@register_policy_loss("gspo")
def gspo_loss(x: PolicyInputs, cfg):
  """GSPO (token form): a sequence-level ratio, clipped PPO-style.

  log s_i = mean_t(m * (log pi - log pi_old)) over the sequence's valid tokens;
  s_it = sg(s_i) * pi_t / sg(pi_t) (value s_i, gradient of log pi_t);
  l = -min(s A, clip(s, 1 - eps_low, 1 + eps_high) A).
  """
  eps_low, eps_high = cfg.gspo.eps_low, cfg.gspo.eps_high
  m = x.loss_mask.astype(jnp.float32)
  log_ratio = x.logprobs - x.old_logprobs
  seq_log_ratio = (log_ratio * m).sum(-1, keepdims=True) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
  tok = x.logprobs - jax.lax.stop_gradient(x.logprobs) + jax.lax.stop_gradient(seq_log_ratio)
  ratio = jnp.exp(jnp.minimum(tok, 10.0))
  surr1 = ratio * x.advantages
  surr2 = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * x.advantages
  loss = -jnp.minimum(surr1, surr2)
  return loss, {"clip_frac": _f(surr2 < surr1)}


@register_policy_loss("rollout_is")
def rollout_is_loss(x: PolicyInputs, cfg):
  """Importance-weighted policy gradient against the rollout policy, band-limited.

  r = pi/pi_rollout; w = r inside (1 - eps_low, 1 + eps_high), 0 outside;
  l = -sg(w) * A * log pi   (gradient: -w A grad log pi).
  """
  eps_low, eps_high = cfg.rollout_is.eps_low, cfg.rollout_is.eps_high
  ratio = _ratio(x.logprobs, x.rollout_logprobs)
  in_band = (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)
  w = jax.lax.stop_gradient(jnp.where(in_band, ratio, 0.0))
  loss = -w * x.advantages * x.logprobs
  return loss, {"clip_frac": _f(~in_band)}


@register_policy_loss("dppo_binary_tv")
def dppo_binary_tv_loss(x: PolicyInputs, cfg):
  """DPPO with the binary total-variation trust region (arXiv 2602.04879).

  The trust region is a bound on the move of the sampled token's probability itself,
  p = pi(a|s) against p_b = pi_rollout(a|s), and only in the direction the advantage pushes:
    A > 0: the token is kept while p - p_b <= delta_high,
    A <= 0: the token is kept while p - p_b >= -delta_low.
  Kept tokens contribute the plain importance-weighted surrogate -r A with
  r = pi/pi_old; dropped tokens contribute nothing (mask is not differentiated).
  """
  d_low, d_high = cfg.dppo.delta_low, cfg.dppo.delta_high
  p = jnp.exp(x.logprobs)
  p_b = jnp.exp(x.rollout_logprobs)
  diff = jax.lax.stop_gradient(p - p_b)
  keep = jnp.where(x.advantages > 0, diff <= d_high, diff >= -d_low)
  ratio = _ratio(x.logprobs, x.old_logprobs)
  loss = -ratio * x.advantages * jax.lax.stop_gradient(keep.astype(ratio.dtype))
  masked = ~keep
  return loss, {
      "clip_frac": _f(masked),
      "clip_frac_high": _f(masked & (x.advantages > 0)),
      "clip_frac_low": _f(masked & (x.advantages <= 0)),
  }


# ----------------------------------------------------------------------------- extras


def truncated_is_weights(old_logprobs, rollout_logprobs, loss_mask, mode: str, cap: float):
  """Truncated importance-sampling weights [batch, seq] (no gradient).

  Corrects for the mismatch between the trainer's old policy and the inference engine:
    token:    w_t = min(pi_old_t / pi_rollout_t, cap)
    sequence: w_i = min(prod_t (pi_old_t / pi_rollout_t)^{m_t}, cap), same for all tokens.
  mode "none" gives ones.
  """
  if mode == "none":
    return jnp.ones_like(old_logprobs, dtype=jnp.float32)
  delta = (old_logprobs - rollout_logprobs).astype(jnp.float32)
  if mode == "token":
    w = jnp.minimum(jnp.exp(jnp.clip(delta, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)), cap)
  elif mode == "sequence":
    seq = (delta * loss_mask).sum(-1, keepdims=True)
    w = jnp.minimum(jnp.exp(jnp.clip(seq, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)), cap)
    w = jnp.broadcast_to(w, delta.shape)
  else:
    raise ValueError(f"unknown rl.tis.mode {mode!r}; use none | token | sequence")
  return jax.lax.stop_gradient(w)


def kl_penalty(logprobs, ref_logprobs, estimator: str):
  """Per-token KL(pi || pi_ref) estimate on samples of pi [batch, seq].

  k1: log pi - log pi_ref (unbiased, can be negative);
  k3: exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1 (unbiased, non-negative).
  """
  if estimator == "k1":
    return logprobs - ref_logprobs
  if estimator == "k3":
    d = jnp.clip(ref_logprobs - logprobs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return jnp.exp(d) - d - 1.0
  raise ValueError(f"unknown rl.kl.estimator {estimator!r}; use k1 | k3")


def compute_policy_loss(x: PolicyInputs, cfg: ml_collections.ConfigDict,
                        ref_logprobs: Optional[jax.Array] = None,
                        entropy: Optional[jax.Array] = None):
  """The configured policy loss with TIS and KL applied, plus per-token diagnostics.

  Args:
    x: token-aligned inputs, [batch, seq] each.
    cfg: the `c.rl` section (policy_loss, ppo, gspo, rollout_is, dppo, tis, kl).
    ref_logprobs: [batch, seq] reference-policy logprobs; required when cfg.kl.coef > 0.
    entropy: optional [batch, seq] per-token entropy of the current policy (metric only).

  Returns:
    token_loss [batch, seq] (NOT masked; the reduction applies the mask), and a dict of
    per-token metric arrays [batch, seq] to be token-averaged by the caller.
  """
  loss, metrics = get_policy_loss(cfg.policy_loss)(x, cfg)
  metrics = {f"policy/{k}": v for k, v in metrics.items()}
  if cfg.tis.mode != "none":
    w = truncated_is_weights(x.old_logprobs, x.rollout_logprobs, x.loss_mask, cfg.tis.mode,
                             cfg.tis.cap)
    loss = loss * w
    metrics["policy/tis_weight"] = w
  metrics["policy/pg_loss"] = jax.lax.stop_gradient(loss)
  if cfg.kl.coef:
    if ref_logprobs is None:
      raise ValueError("rl.kl.coef > 0 needs ref_logprobs in the batch")
    kl = kl_penalty(x.logprobs, ref_logprobs, cfg.kl.estimator)
    loss = loss + cfg.kl.coef * kl
    metrics["policy/kl_ref"] = jax.lax.stop_gradient(kl)
  metrics.update(diagnostics(x, entropy))
  return loss, metrics


def diagnostics(x: PolicyInputs, entropy: Optional[jax.Array] = None) -> dict[str, jax.Array]:
  """Per-token diagnostics (no gradient): approx KL to the old policy, train-vs-rollout."""
  lp = jax.lax.stop_gradient(x.logprobs).astype(jnp.float32)
  old = x.old_logprobs.astype(jnp.float32)
  roll = x.rollout_logprobs.astype(jnp.float32)
  d = jnp.clip(lp - old, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  out = {
      # k3 estimate of KL(pi_old || pi) on samples of pi_old: (r - 1) - log r.
      "policy/approx_kl": jnp.exp(d) - 1.0 - d,
      "policy/logprob_diff_vs_rollout": lp - roll,
      "policy/abs_logprob_diff_vs_rollout": jnp.abs(lp - roll),
      "policy/prob_diff_vs_rollout": jnp.abs(jnp.exp(lp) - jnp.exp(roll)),
  }
  if entropy is not None:
    out["policy/entropy"] = jax.lax.stop_gradient(entropy).astype(jnp.float32)
  return out
