"""Causal flash attention as Pallas (Triton) kernels for GPUs: `model.attention_impl=pallas`.

JAX's own kernel (`jax.experimental.pallas.ops.gpu.attention.mha`), a maintained one, runs the
forward and the backward as Triton programs that hold a block of queries' scores on chip: the
[t, t] scores and probabilities are never written, and the backward recomputes them from the
forward's log-sum-exp. Its loops over key blocks stop at the diagonal, so a causal row costs
about half the square. It is the GPU attention where cuDNN's cannot run: cuDNN's flash
attention needs 16-bit activations and the cuDNN library, which is not there when compiling
for a GPU from a CPU machine (`--mode=compile`), where this kernel compiles in its place.

Grouped-query attention: the kernel takes as many key and value heads as query heads, so each
kv head is repeated for its group of query heads first (query head i reads kv head i // group,
as `attention._attend`'s grouping); the repeat's gradient sums the group's back.

On CPU Pallas' interpreter runs the same kernel (the tests; slow: not for training there). TPU
has no such kernel: "xla" there.
"""
import functools

import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as pallas_attention

from models.layers import common

# Tile sizes: queries x keys a forward program holds, and the backward's (queries and keys per
# step of its dk/dv and dq loops). Untimed: sized so that a head of 256 (35B-A3B) keeps its
# double-buffered key and value tiles within an H100/H200's 228 KiB of shared memory.
BLOCK_Q, BLOCK_K = 128, 64
BACKWARD_BLOCK, BACKWARD_BLOCK_WIDE = 64, 32     # heads of up to 128; wider ones


def _padded(t: int) -> int:
  """The row length the kernel runs: whole query blocks (Triton's blocks are powers of two),
  a power of two >= 16 for rows shorter than one."""
  if t < BLOCK_Q:
    return max(16, 1 << (t - 1).bit_length())
  return -(-t // BLOCK_Q) * BLOCK_Q


def _block_sizes(head_dim: int, t: int) -> pallas_attention.BlockSizes:
  """Tile sizes for rows of `t` (a `_padded` length: every block divides it)."""
  back = min(BACKWARD_BLOCK if head_dim <= 128 else BACKWARD_BLOCK_WIDE, t)
  return pallas_attention.BlockSizes(block_q=min(BLOCK_Q, t), block_k=min(BLOCK_K, t),
                                     block_q_dkv=back, block_kv_dkv=back, block_q_dq=back,
                                     block_kv_dq=back)


def _local(q, k, v, interpret: bool):
  """`causal` on one device's rows and heads (as many kv heads as query heads)."""
  t, hd = q.shape[1], q.shape[3]
  padded = _padded(t)
  if padded != t:
    # After the last position, where the causal mask hides the padding from every real query.
    pad = [(0, 0), (0, padded - t), (0, 0), (0, 0)]
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
  out = pallas_attention.mha(q, k, v, None, sm_scale=hd ** -0.5, causal=True,
                             block_sizes=_block_sizes(hd, padded), interpret=interpret)
  return out[:, :t]


def causal(q, k, v):
  """Causal softmax attention of q [b, t, heads, hd] over k, v [b, t, kv_heads, hd], query i
  seeing keys 0..i; returns [b, t, heads, hd] in q's dtype (the softmax in float32)."""
  interpret = common.triton_interpret("attention_impl=pallas", "xla")
  if not interpret:
    common.check_triton_dims("attention_impl=pallas", (("head_dim", q.shape[3]),))
  group = q.shape[2] // k.shape[2]
  if group > 1:
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
  local = functools.partial(_local, interpret=interpret)
  # Per device over the rows and heads, each row whole.
  axes = ("batch", None, "activation_heads")
  return common.per_device(local, (q, k, v), (axes,) * 3, axes)
