"""Loss reductions for GRPO-style training, exact under micro-batching and data parallelism.

A reduction turns per-token losses l [batch, seq] and the loss mask m [batch, seq] into one
scalar. Every reduction here is linear in l, so it is written as per-token weights

  loss = sum_it w_it * l_it,     w = reduction_weights(m, group_ids, mode, max_seq_len)

with all denominators (token counts, sequence counts, prompt counts) taken from the WHOLE
mini-batch. A micro-batch (or a data-parallel shard) then contributes sum over its own rows
of w * l, and the contributions add up to the mini-batch loss exactly: the numerator is
split, the denominator is not. This is what "carry numerator and denominator separately"
means in practice.

Modes (B live sequences, |o_i| valid tokens of sequence i, P live prompt groups):
  token_mean               sum_it m l / sum_it m
  sequence_mean            (1/B) sum_i (sum_t m l / |o_i|)
  seq_mean_token_sum_norm  (1/B) sum_i sum_t m l / max_seq_len          (Dr. GRPO)
  prompt_mean              (1/P) sum_p (sum_{i in p} sum_t m l / sum_{i in p} |o_i|)

A sequence is live when it has at least one loss token; a group is live when one of its
sequences is. Dead rows (padding, masked groups, zero-variance groups) therefore neither add
to nor dilute the average.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from rl import advantages
from rl import registry

WeightFn = Callable[[jax.Array, jax.Array, Optional[int]], jax.Array]

_REDUCTIONS: registry.Registry[WeightFn] = registry.Registry("loss reduction")
register_loss_reduction = _REDUCTIONS.register
available_loss_reductions = _REDUCTIONS.names


def reduction_weights(loss_mask: jax.Array, group_ids: jax.Array, mode: str,
                      max_seq_len: Optional[int] = None) -> jax.Array:
  """Per-token weights [batch, seq] (float32) such that loss = sum(w * token_loss).

  Args:
    loss_mask: [batch, seq] 0/1 (bool, int or float).
    group_ids: [batch] int, equal for the samples of one prompt.
    mode: a registered reduction name.
    max_seq_len: the constant of seq_mean_token_sum_norm (default: seq).
  """
  return _REDUCTIONS.get(mode)(loss_mask.astype(jnp.float32), group_ids, max_seq_len)


def reduce_loss(token_loss: jax.Array, loss_mask: jax.Array, group_ids: jax.Array, mode: str,
                max_seq_len: Optional[int] = None) -> jax.Array:
  """The scalar loss of a whole mini-batch; token_loss, loss_mask [batch, seq], group_ids [batch]."""
  w = reduction_weights(loss_mask, group_ids, mode, max_seq_len)
  return jnp.sum(w * token_loss.astype(jnp.float32))


def _live_sequences(m):
  n = m.sum(axis=1)                                     # [batch] |o_i|
  return n, (n > 0).astype(jnp.float32)


@register_loss_reduction("token_mean")
def _token_mean(m, group_ids, max_seq_len):
  del group_ids, max_seq_len
  return m / jnp.maximum(m.sum(), 1.0)


@register_loss_reduction("sequence_mean")
def _sequence_mean(m, group_ids, max_seq_len):
  del group_ids, max_seq_len
  n, live = _live_sequences(m)
  num_seqs = jnp.maximum(live.sum(), 1.0)
  return m / (jnp.maximum(n, 1.0)[:, None] * num_seqs)


@register_loss_reduction("seq_mean_token_sum_norm")
def _seq_mean_token_sum_norm(m, group_ids, max_seq_len):
  del group_ids
  if max_seq_len is None:
    max_seq_len = m.shape[1]
  _, live = _live_sequences(m)
  num_seqs = jnp.maximum(live.sum(), 1.0)
  return m / (float(max_seq_len) * num_seqs)


@register_loss_reduction("prompt_mean")
def _prompt_mean(m, group_ids, max_seq_len):
  del max_seq_len
  n, _ = _live_sequences(m)
  same = (group_ids[:, None] == group_ids[None, :]).astype(jnp.float32)   # [batch, batch]
  group_tokens = same @ n                                                 # [batch] sum_{j in p(i)} |o_j|
  group_size = same.sum(axis=1)                                           # [batch] samples in p(i)
  group_live = (group_tokens > 0).astype(jnp.float32)
  num_prompts = jnp.maximum(jnp.round((group_live / group_size).sum()), 1.0)
  return m / (jnp.maximum(group_tokens, 1.0)[:, None] * num_prompts)


# ----------------------------------------------------------------------------- micro-batching


def micro_batch_count(rows: int, requested: int, batch_ways: int) -> int:
  """How many micro-batches a mini-batch of `rows` rows runs in, its rows split over
  `batch_ways` devices: `requested` (train.micro_batches), or, where that leaves a device a
  different number of rows than its peers (fewer rows a micro-batch than devices, say), the
  most below it that gives every device the same whole number (1 if none does).

  A micro-batch of fewer rows than devices saves no memory a device, since a device holds at
  least one row, and costs time: XLA lays out each such micro-batch by gathering and
  replicating it. The tiny default's 8 micro-batches of 2 rows on 8 CPU devices took 8x the
  time a step of its 2 micro-batches of 8 rows took (docs/results.md).
  """
  for n in range(max(min(requested, rows), 1), 0, -1):
    if rows % n == 0 and (rows // n) % batch_ways == 0:
      return n
  return 1


def split_micro_batches(tree: Any, num_micro_batches: int) -> Any:
  """[batch, ...] leaves -> [num_micro_batches, batch // num_micro_batches, ...].

  Strided split: micro-batch k holds rows k, k + n, k + 2n, ... With the batch sharded in
  contiguous blocks over data-parallel devices, every device keeps exactly its own rows in
  every micro-batch, so the split moves no data between devices.
  """
  def split(x):
    b = x.shape[0]
    if b % num_micro_batches:
      raise ValueError(f"batch {b} is not divisible into {num_micro_batches} micro-batches")
    x = x.reshape(b // num_micro_batches, num_micro_batches, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, tree)


def microbatched_value_and_grad(loss_fn: Callable, params: Any, batch: Any,
                                num_micro_batches: int,
                                is_live: Optional[Callable[[Any], jax.Array]] = None,
                                grad_shardings: Any = None):
  """Sum of value_and_grad(loss_fn) over micro-batches, accumulated in a lax.scan.

  Args:
    loss_fn: (params, micro_batch) -> (loss, aux), where loss and every aux leaf are SUMS
      of per-row contributions already weighted with whole-mini-batch weights (see
      `reduction_weights`), so that summing over micro-batches gives the mini-batch value.
    params: differentiated pytree.
    batch: pytree of [batch, ...] arrays.
    num_micro_batches: how many sequential micro-batches; 1 = no scan.
    is_live: micro_batch -> scalar bool. A micro-batch for which it is False must contribute
      exactly zero (e.g. no loss token: every weight is 0); its forward and backward are
      skipped (lax.cond), so rows of filtered groups cost nothing once `pack_live_rows` has
      gathered them into whole micro-batches.
    grad_shardings: optional pytree of shardings like `params`: the float32 gradient
      accumulator and each micro-batch's gradients are laid out like the parameters they
      belong to. Left to itself, XLA:GPU kept some of them whole on every device (35B-A3B's
      stacked expert gradients: 10 GiB a matrix; docs/results.md).

  Returns:
    (loss, aux), grads: each the sum over micro-batches (float32 accumulators).
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if num_micro_batches == 1:
    return grad_fn(params, batch)
  micro = split_micro_batches(batch, num_micro_batches)
  first = jax.tree.map(lambda x: x[0], micro)
  out_shape = jax.eval_shape(grad_fn, params, first)

  def laid_out(out):
    if grad_shardings is None:
      return out
    value, grads = out
    return value, jax.lax.with_sharding_constraint(grads, grad_shardings)

  zeros = laid_out(jax.tree.map(
      lambda s: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32)), out_shape))

  def computed(mb):
    return laid_out(grad_fn(params, mb))

  def skipped(_):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

  # A micro-batch's gradients leave its branch in their own dtype and are cast in the sum
  # (one pass: each bfloat16 gradient read once into the float32 sum). Cast inside the branch,
  # each was first written out as a float32 copy, then read again (35B-A3B's one-cycle slice
  # on one H200: 316 GiB a step in the two passes, 163 in the one; compiler figures,
  # docs/results.md#one-h200).
  # The sum stays outside the branch: as a branch's operand, XLA copied it whole every step.
  def body(acc, mb):
    out = computed(mb) if is_live is None else jax.lax.cond(is_live(mb), computed, skipped, mb)
    return laid_out(jax.tree.map(lambda a, o: a + o.astype(a.dtype), acc, out)), None

  acc, _ = jax.lax.scan(body, zeros, micro)
  return laid_out(acc)


def live_rows(rewards, group_ids, valid, loss_mask, filter_zero_variance: bool) -> np.ndarray:
  """[batch] bool (host): rows that can carry a loss token after group filtering, i.e. valid,
  with a loss token, and (when zero-variance groups are filtered) not in a group whose valid
  rewards are all equal, by `advantages.zero_variance_mask`, the rule the train step applies.
  Used only to order rows, so it decides speed, never correctness."""
  valid = np.asarray(valid, bool)
  live = valid & (np.asarray(loss_mask).sum(axis=1) > 0)
  if filter_zero_variance:
    live &= ~np.asarray(advantages.zero_variance_mask(
        jnp.asarray(rewards), jnp.asarray(group_ids), jnp.asarray(valid)))
  return live


def pack_live_rows(batch: dict, live: np.ndarray, num_micro_batches: int) -> dict:
  """The batch's rows reordered (host numpy) so that live rows fill the first micro-batches of
  `split_micro_batches` (strided: row i goes to micro-batch i % n) and dead rows the last ones.

  Every reduction is invariant to the order of rows (weights come from the whole batch,
  groups from group_ids), so this changes no loss, gradient or metric; it lets
  `microbatched_value_and_grad(is_live=...)` skip whole micro-batches of filtered groups.
  """
  live = np.asarray(live, bool)
  b, n = live.shape[0], int(num_micro_batches)
  if n <= 1 or b % n:
    return batch
  # Row slots in fill order: micro-batch 0 (rows 0, n, 2n, ...), then micro-batch 1, ...
  slots = np.arange(b).reshape(b // n, n).T.reshape(-1)
  order = np.concatenate([np.flatnonzero(live), np.flatnonzero(~live)])
  perm = np.empty(b, np.int64)
  perm[slots] = order
  return {k: np.asarray(v)[perm] for k, v in batch.items()}
