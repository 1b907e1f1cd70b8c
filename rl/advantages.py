"""Advantage estimators for outcome-reward RL, chosen by config string.

Every estimator maps per-sample scalar rewards to per-sample scalar advantages:

  estimator(rewards [batch], group_ids [batch], valid [batch], cfg) -> advantages [batch]

`group_ids` are ints, equal for the samples of one prompt (any values; they need not be
contiguous or sorted). `valid` is False for samples that are excluded from training (masked
groups, padding rows): they neither contribute to a group's statistics nor receive an
advantage (their advantage is 0).

Group statistics use a [batch, batch] same-group matrix instead of a segment reduction, so
the functions are jit-able for arbitrary integer ids. Batches are a few hundred samples, so
the quadratic cost is negligible next to one forward pass.

Host-side helpers (`mask_groups`) work on numpy arrays before the batch enters the step; a
whole group can be excluded with a named reason, and the reasons are counted.
"""
from __future__ import annotations

import collections
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rl import registry

AdvantageFn = Callable[[jax.Array, jax.Array, jax.Array, ml_collections.ConfigDict], jax.Array]

_ESTIMATORS: registry.Registry[AdvantageFn] = registry.Registry("advantage estimator")
register_advantage_estimator = _ESTIMATORS.register
get_advantage_estimator = _ESTIMATORS.get
available_advantage_estimators = _ESTIMATORS.names


def _same_group(group_ids: jax.Array, valid: jax.Array) -> jax.Array:
  """[batch, batch] float: 1 where column j is a valid sample of row i's group."""
  same = group_ids[:, None] == group_ids[None, :]
  return (same & valid[None, :].astype(bool)).astype(jnp.float32)


def group_stats(rewards: jax.Array, group_ids: jax.Array, valid: jax.Array):
  """Per-sample statistics of the sample's own group, over valid members only.

  Returns:
    count [batch], mean [batch], std [batch] (unbiased, 0 for groups of size < 2).
  """
  rewards = rewards.astype(jnp.float32)
  same = _same_group(group_ids, valid)
  count = same.sum(axis=1)
  safe = jnp.maximum(count, 1.0)
  mean = (same @ rewards) / safe
  sq = (same * (rewards[None, :] - mean[:, None]) ** 2).sum(axis=1)
  var = jnp.where(count > 1, sq / jnp.maximum(count - 1.0, 1.0), 0.0)
  return count, mean, jnp.sqrt(var)


@register_advantage_estimator("grpo")
def grpo_advantages(rewards, group_ids, valid, cfg):
  """GRPO: reward minus the group mean, optionally divided by the group std.

  cfg.grpo_norm_by_std: divide by (std + cfg.advantage_eps).
  A group of one valid sample gets advantage 0.
  """
  count, mean, std = group_stats(rewards, group_ids, valid)
  adv = rewards.astype(jnp.float32) - mean
  if cfg.grpo_norm_by_std:
    adv = adv / (std + cfg.advantage_eps)
  adv = jnp.where(count > 1, adv, 0.0)
  return jnp.where(valid, adv, 0.0)


@register_advantage_estimator("rloo")
def rloo_advantages(rewards, group_ids, valid, cfg):
  """RLOO: reward minus the mean of the *other* samples of the group.

  r_i - (sum_j r_j - r_i) / (n - 1) = n / (n - 1) * (r_i - mean). Groups of one get 0.
  """
  del cfg
  count, mean, _ = group_stats(rewards, group_ids, valid)
  factor = count / jnp.maximum(count - 1.0, 1.0)
  adv = jnp.where(count > 1, (rewards.astype(jnp.float32) - mean) * factor, 0.0)
  return jnp.where(valid, adv, 0.0)


def zero_variance_mask(rewards: jax.Array, group_ids: jax.Array, valid: jax.Array,
                       atol: float = 0.0) -> jax.Array:
  """[batch] bool: True for valid samples whose group's valid rewards are all equal.

  Such groups carry no GRPO signal (every advantage is 0) but still add tokens to the
  denominators; the recipe drops them.
  """
  same = _same_group(group_ids, valid)
  rewards = rewards.astype(jnp.float32)
  big = jnp.float32(jnp.inf)
  gmax = jnp.max(jnp.where(same > 0, rewards[None, :], -big), axis=1)
  gmin = jnp.min(jnp.where(same > 0, rewards[None, :], big), axis=1)
  return valid.astype(bool) & (gmax - gmin <= atol)


def compute_advantages(rewards: jax.Array, group_ids: jax.Array, valid: jax.Array,
                       cfg: ml_collections.ConfigDict):
  """Advantages and the final validity mask as the RL config asks.

  Args:
    rewards: [batch] float.
    group_ids: [batch] int.
    valid: [batch] bool (False = excluded before the step: masked group, padding).
    cfg: the `c.rl` config section (advantage, filter_zero_variance, ...).

  Returns:
    advantages [batch] float32, valid [batch] bool (zero-variance groups removed when
    cfg.filter_zero_variance), metrics dict of scalars.
  """
  valid = valid.astype(bool)
  zero_var = zero_variance_mask(rewards, group_ids, valid)
  if cfg.filter_zero_variance:
    valid = valid & ~zero_var
  adv = get_advantage_estimator(cfg.advantage)(rewards, group_ids, valid, cfg)
  n_valid = jnp.maximum(valid.sum(), 1)
  metrics = {
      "adv/zero_variance_frac": zero_var.sum() / jnp.maximum(valid.size, 1),
      "adv/valid_frac": valid.sum() / jnp.maximum(valid.size, 1),
      "adv/mean_abs": jnp.abs(adv).sum() / n_valid,
      "reward/mean": jnp.where(valid, rewards, 0.0).sum() / n_valid,
  }
  return adv, valid, metrics


# ----------------------------------------------------------------------------- host side


def mask_groups(group_ids, exclude: Mapping[int, str], valid=None):
  """Excludes whole groups, each with a reason (host-side, numpy).

  Args:
    group_ids: [batch] ints.
    exclude: group id -> reason (e.g. {7: "env_error", 9: "timeouts"}).
    valid: optional [batch] bool to start from (default all True).

  Returns:
    valid [batch] bool, and a Counter reason -> number of samples excluded for it.
  """
  group_ids = np.asarray(group_ids)
  valid = np.ones(group_ids.shape, bool) if valid is None else np.asarray(valid, bool).copy()
  reasons: collections.Counter = collections.Counter()
  for gid, reason in exclude.items():
    hit = (group_ids == gid) & valid
    if hit.any():
      reasons[reason] += int(hit.sum())
    valid &= group_ids != gid
  return valid, reasons
