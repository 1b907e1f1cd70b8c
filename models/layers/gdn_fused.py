"""The chunked delta rule's walk over chunks, and its chunks' outputs, each one GPU kernel a
pass (`model.gdn_scan=fused`).

`gated_deltanet.chunked_delta_rule` reduces each chunk of c positions to a few tensors; across
the chunks only the state's recurrence is sequential (a_i the chunk's total decay, a scalar):

    v_new_i = u_i - w_i S_i                 [c, d_v]     the chunk's values less the predicted
    S_{i+1} = a_i S_i + k_i^T v_new_i       [d_k, d_v]

As a `lax.scan` this is n steps of small matmuls, each step a handful of GPU kernels, forward,
recomputed and backward: on an H200 the ~1B model's training step was ~21,000 kernels, three in
four of them these walks (docs/results.md, "One H200"). Here each walk is one Triton kernel
(Pallas), one program per (row, head, block of `BLOCK_V` state columns): the block of the state
stays in the program's registers from the first chunk to the last. The state's columns are
independent (a_i is a scalar), so the programs share nothing.

The backward is the reverse walk, one kernel too. With G_i the cotangent of S_i (dS_i what the
caller's use of the returned S_i adds, dv_new_i that of v_new_i):

    G_n = dS_final;   dv_i = dv_new_i + k_i G_{i+1};   G_i = a_i G_{i+1} - w_i^T dv_i + dS_i

and then, for every chunk at once: du_i = dv_i, dw_i = -dv_i S_i^T, dk_i = v_new_i G_{i+1}^T,
da_i = <S_i, G_{i+1}>. The residuals are the walk's own outputs (S_i, v_new_i) and inputs.

The outputs, q_i S_i plus the chunk's own causal term, are a second kernel pair (below,
`chunk_outputs`), which builds the chunk's q k^T and decays in registers.

On GPU the kernels are compiled by XLA's Triton pipeline (also when compiling for a GPU target
from a CPU, `--mode=compile`); on CPU Pallas' interpreter runs the same kernel (the tests). TPU
has no such kernel here (Pallas for TPU is another kernel language): `fused` is an error there.
On a mesh the walk runs per device (`jax.shard_map`) over its rows and heads: XLA does not
partition a Pallas kernel. Each (row, head) must then be whole on one device, which the
Gated DeltaNet's layout already asks for (the walk runs along the row).
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from models.layers import common

# State columns a program holds: with d_k = 128 a [128, 32] float32 block is 32 registers a
# thread of 4 warps. Chosen from the register budget, not timed (no GPU run yet).
BLOCK_V = 32
NUM_WARPS = 4
# Logical axes the kernels run per device over (`common.per_device`): rows and heads, after
# the chunks or the stacked layers, which every device holds whole.
_ROWS_HEADS = ("batch", "activation_heads")
_CHUNKED = (None, *_ROWS_HEADS)
_STACKED = (None, *_ROWS_HEADS)


def _f32(x):
  """A block as loaded, in float32: every kernel computes in float32 whatever its tensors are
  stored in (`model.gdn_storage_dtype`), and rounds only what it stores."""
  return x.astype(jnp.float32)


def _forward_kernel(u_ref, w_ref, k_ref, a_ref, s0_ref, states_ref, v_new_ref, final_ref, *,
                    chunks: int, precision):
  """One program's walk over every chunk: refs [n, c, d] / [n] / [d_k, BLOCK_V]."""
  def step(i, s):
    states_ref[i] = s.astype(states_ref.dtype)
    v_new = _f32(u_ref[i]) - jnp.dot(_f32(w_ref[i]), s, precision=precision)
    v_new_ref[i] = v_new.astype(v_new_ref.dtype)
    return s * a_ref[i] + jnp.dot(_f32(k_ref[i]).T, v_new, precision=precision)

  final_ref[...] = jax.lax.fori_loop(0, chunks, step, _f32(s0_ref[...]))


def _backward_kernel(w_ref, k_ref, a_ref, d_states_ref, d_v_new_ref, d_final_ref,
                     g_next_ref, d_v_ref, d_s0_ref, *, chunks: int, precision):
  """The reverse walk: G_{i+1} and dv_i of every chunk, and G_0 (module docstring)."""
  def step(j, g):
    i = chunks - 1 - j
    g_next_ref[i] = g.astype(g_next_ref.dtype)
    d_v = _f32(d_v_new_ref[i]) + jnp.dot(_f32(k_ref[i]), g, precision=precision)
    d_v_ref[i] = d_v.astype(d_v_ref.dtype)
    return (g * a_ref[i] - jnp.dot(_f32(w_ref[i]).T, d_v, precision=precision)
            + _f32(d_states_ref[i]))

  d_s0_ref[...] = jax.lax.fori_loop(0, chunks, step, _f32(d_final_ref[...]))


def _in_kernel(precision, interpret: bool):
  """The precision a kernel's float32 dots take for `model.gdn_precision`'s `precision`.

  Compiled for a GPU, `highest` is three TF32 passes (Triton's tf32x3: each operand split into
  a TF32 high part and the rest, float32 accuracy to a few units in the last place) rather
  than float32 on the CUDA cores, which an H200 runs at about a seventh of TF32's rate: at
  that rate the output kernels' matmuls (~1.1 TFLOP a step of the ~1B model) would take about
  twice their memory traffic's time. Pallas' interpreter (the CPU) keeps HIGHEST; `high` and
  `default` stay one TF32 pass.
  """
  if precision == jax.lax.Precision.HIGHEST and not interpret:
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return precision


def _spec(x, whole: bool, block_v: int) -> pl.BlockSpec:
  """A program's block of `x`: [n, rows x heads] decays whole; [rows x heads, d_k, d_v] states
  and [n, rows x heads, c or d_k, d_v] tensors by columns; `whole`: [n, rows x heads, c, d_k]."""
  if x.ndim == 2:
    return pl.BlockSpec((x.shape[0], None), lambda r, j: (0, r))
  if x.ndim == 3:
    return pl.BlockSpec((None, x.shape[1], block_v), lambda r, j: (r, 0, j))
  if whole:
    return pl.BlockSpec((x.shape[0], None, x.shape[2], x.shape[3]), lambda r, j: (0, r, 0, 0))
  return pl.BlockSpec((x.shape[0], None, x.shape[2], block_v), lambda r, j: (0, r, 0, j))


def _call(kernel, inputs, whole, outputs, interpret: bool):
  """`kernel` over the grid (rows x heads, d_v / BLOCK_V); `whole[i]`: whether input i is
  read whole ([n, rows x heads, c, d_k]) rather than by the program's state columns."""
  rows, dv = outputs[-1].shape[0], outputs[-1].shape[-1]
  block_v = min(BLOCK_V, dv)
  if dv % block_v:
    raise ValueError(f"gdn_scan=fused: the value head dim {dv} is not a multiple of {block_v}")
  return pl.pallas_call(
      kernel, out_shape=outputs, grid=(rows, dv // block_v),
      in_specs=[_spec(x, w, block_v) for x, w in zip(inputs, whole)],
      out_specs=[_spec(o, False, block_v) for o in outputs],
      interpret=interpret,
      compiler_params=None if interpret else pl_triton.CompilerParams(num_warps=NUM_WARPS,
                                                                      num_stages=1),
  )(*inputs)


# The walk over [n, rows x heads, ...] arrays; `precision` of the kernels' and the gradient's
# matmuls (`model.gdn_precision`; on a GPU highest is full float32, high / default TF32).
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _walk(u, w, k, a, s0, precision, interpret: bool):
  return _walk_forward(u, w, k, a, s0, precision, interpret)[0]


def _walk_forward(u, w, k, a, s0, precision, interpret: bool):
  n, rows, c, dv = u.shape
  dk = w.shape[-1]
  stored = u.dtype               # the states and corrected values as u is; S_n in float32
  outputs = (jax.ShapeDtypeStruct((n, rows, dk, dv), stored),   # S_i, the state before chunk i
             jax.ShapeDtypeStruct((n, rows, c, dv), stored),    # v_new_i
             jax.ShapeDtypeStruct((rows, dk, dv), jnp.float32))  # S_n
  kernel = functools.partial(_forward_kernel, chunks=n,
                             precision=_in_kernel(precision, interpret))
  states, v_new, final = _call(kernel, (u, w, k, a, s0), (False, True, True, False, False),
                               outputs, interpret)
  return (states, v_new, final), (w, k, a, states, v_new)


def _walk_backward(precision, interpret: bool, residuals, cotangents):
  w, k, a, states, v_new = residuals
  d_states, d_v_new, d_final = cotangents
  outputs = (jax.ShapeDtypeStruct(states.shape, states.dtype),  # G_{i+1}
             jax.ShapeDtypeStruct(v_new.shape, v_new.dtype),    # dv_i
             jax.ShapeDtypeStruct(d_final.shape, jnp.float32))  # G_0
  kernel = functools.partial(_backward_kernel, chunks=w.shape[0],
                             precision=_in_kernel(precision, interpret))
  g_next, d_v, d_s0 = _call(kernel, (w, k, a, d_states, d_v_new, d_final),
                            (True, True, False, False, False, False), outputs, interpret)
  einsum = functools.partial(jnp.einsum, precision=precision,
                             preferred_element_type=jnp.float32)
  d_w = -einsum("nrcv,nrkv->nrck", d_v, states)
  d_k = einsum("nrcv,nrkv->nrck", v_new, g_next)
  d_a = einsum("nrkv,nrkv->nr", states, g_next)
  return d_v, d_w.astype(w.dtype), d_k.astype(k.dtype), d_a, d_s0


_walk.defvjp(_walk_forward, _walk_backward)


def _rows(*xs):
  """Each [n_chunks, batch, heads, ...] array of `xs` as [n_chunks, batch x heads, ...]."""
  n, b, h = xs[0].shape[:3]
  return tuple(x.reshape(n, b * h, *x.shape[3:]) for x in xs)


def _walk_local(u, w, k, decay, state, precision, interpret: bool):
  """`walk` on one device's rows and heads."""
  n, b, h = u.shape[:3]
  states, v_new, final = _walk(*_rows(u, w, k, decay), state.reshape(b * h, *state.shape[2:]),
                               precision, interpret)
  return (states.reshape(n, b, h, *states.shape[2:]), v_new.reshape(u.shape),
          final.reshape(state.shape))


def walk(u, w, k, decay, state, precision: str = "highest"):
  """The states' recurrence over the chunks (module docstring), one kernel a pass.

  Args:
    u, w, k: [n_chunks, batch, heads, chunk, d] float32 (d: d_v for u, d_k for w and k).
    decay: [n_chunks, batch, heads] each chunk's total decay a_i.
    state: [batch, heads, d_k, d_v] float32, the state before the first chunk.
  Returns:
    (states [n_chunks, batch, heads, d_k, d_v], the state before each chunk; v_new [n_chunks,
    batch, heads, chunk, d_v]; the final state).
  """
  interpret = common.triton_interpret("gdn_scan=fused", "outputs or states")
  if not interpret:
    common.check_triton_dims("gdn_scan=fused", (
        ("gdn_chunk_size", u.shape[3]), ("linear_key_head_dim", w.shape[4]),
        ("the value block, min(BLOCK_V, linear_value_head_dim)", min(BLOCK_V, u.shape[4]))))
  local = functools.partial(_walk_local, precision=jax.lax.Precision(precision),
                            interpret=interpret)
  return common.per_device(local, (u, w, k, decay, state), (_CHUNKED,) * 4 + (_ROWS_HEADS,),
                           (_CHUNKED, _CHUNKED, _ROWS_HEADS))


# The chunks' outputs (`model.gdn_scan=fused`): with q_i, k_i [c, d_k] the chunk's keys and
# queries and g_i [c] its log decays,
#
#     out_i = (q_i * e^{G_i}) S_i + ((q_i k_i^T) * D_i) v_new_i      [c, d_v]
#
# where G_i is g_i's running sum and D_i [c, c] the decay from position j to i (i >= j, else
# 0). XLA wrote q_i k_i^T, D_i, their product and q_i e^{G_i} to memory as float32 tensors of
# their own, forward and backward, and read them again; here one program a chunk builds them
# in registers from q, k and g (the ~1B GRPO step compiled for an H200: 853 -> 822 GiB a step,
# a compiler estimate; docs/results.md#one-h200). D's logarithm is summed over each
# segment (a running sum down the columns), as `chunked_delta_rule` does, not taken as a
# difference of running sums, which loses the low bits once they reach hundreds.
# State columns a forward program writes: chosen from the register budget, not timed.
OUTPUT_BLOCK_V = 64


def _decays(g):
  """(D [c, c], e^G [c], the masks m <= i and j < m) of one chunk's log decays g [c]."""
  c = g.shape[0]
  row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  upto, before = col <= row, col < row                       # [i, m]: m <= i; [m, j]: j < m
  segment = jnp.cumsum(jnp.where(before, g[:, None], 0.0), axis=0)   # [i, j]: g over (j, i]
  decay = jnp.where(upto, jnp.exp(segment), 0.0)
  return decay, jnp.exp(jnp.cumsum(g)), (upto, before)


def _decays_backward(d_segment, d_running, masks):
  """g's gradient [c] from its segments' (d_segment [c, c], at [i, j]: the sum over (j, i])
  and its running sums' (d_running [c]) (`_decays`): g_m is in segment [i, j] where
  j < m <= i and in running sum i where m <= i."""
  upto, _ = masks
  d_lower = jnp.cumsum(d_segment, axis=1) - d_segment + d_running[:, None]   # [i, m]: j < m
  return jnp.sum(jnp.where(upto, d_lower, 0.0), axis=0)


def _output_kernel(q_ref, k_ref, g_ref, s_ref, v_new_ref, out_ref, *, precision):
  """Program (row x head, chunk, block of state columns): out_i's columns."""
  q = _f32(q_ref[...])
  decay, scale, _ = _decays(g_ref[...])
  qk = jnp.dot(q, _f32(k_ref[...]).T, precision=precision)
  out = (jnp.dot(q * scale[:, None], _f32(s_ref[...]), precision=precision)
         + jnp.dot(qk * decay, _f32(v_new_ref[...]), precision=precision))
  out_ref[...] = out.astype(out_ref.dtype)


def _output_backward_kernel(q_ref, k_ref, g_ref, s_ref, v_new_ref, d_out_ref,
                            d_q_ref, d_k_ref, d_g_ref, d_s_ref, d_v_new_ref, *, precision,
                            block_v: int):
  """Program (row x head, chunk): every gradient of out_i, its state columns a block at a time.

  With A = (q k^T) * D and P = q e^G: dS = P^T dout, dv_new = A^T dout, dA = dout v_new^T,
  dP = dout S^T; dq = dP e^G + (dA * D) k, dk = (dA * D)^T q. The decays' gradient: through
  D, d(segment) = dA * A, through e^G, dP * P summed over d_k; each reaches g_m from every
  (i, j) whose segment or running sum holds m.
  """
  q, k = _f32(q_ref[...]), _f32(k_ref[...])
  dot = functools.partial(jnp.dot, precision=precision)
  decay, scale, masks = _decays(g_ref[...])
  qk = dot(q, k.T)
  q_dec, a = q * scale[:, None], qk * decay
  d_q_dec = jnp.zeros(q.shape, jnp.float32)
  d_a = jnp.zeros(qk.shape, jnp.float32)
  for j in range(d_out_ref.shape[-1] // block_v):
    cols = slice(j * block_v, (j + 1) * block_v)
    d_out = _f32(d_out_ref[:, cols])
    d_q_dec += dot(d_out, _f32(s_ref[:, cols]).T)
    d_a += dot(d_out, _f32(v_new_ref[:, cols]).T)
    d_s_ref[:, cols] = dot(q_dec.T, d_out).astype(d_s_ref.dtype)
    d_v_new_ref[:, cols] = dot(a.T, d_out).astype(d_v_new_ref.dtype)
  d_qk = d_a * decay
  d_q_ref[...] = (d_q_dec * scale[:, None] + dot(d_qk, k)).astype(d_q_ref.dtype)
  d_k_ref[...] = dot(d_qk.T, q).astype(d_k_ref.dtype)
  d_g_ref[...] = _decays_backward(d_a * a, jnp.sum(d_q_dec * q_dec, axis=1), masks)


def _chunk_spec(x, block_v: int | None = None) -> pl.BlockSpec:
  """A program's block of `x` [n, rows x heads, c] or [n, rows x heads, c or d_k, d]: one
  chunk's, whole, or (`block_v`) the program's columns j of it."""
  if x.ndim == 3:
    return pl.BlockSpec((None, None, x.shape[2]), lambda r, i, *_: (i, r, 0))
  if block_v is None:
    return pl.BlockSpec((None, None) + x.shape[2:], lambda r, i, *_: (i, r, 0, 0))
  return pl.BlockSpec((None, None, x.shape[2], block_v), lambda r, i, j: (i, r, 0, j))


def _triton_params(interpret: bool):
  return None if interpret else pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)


def _per_chunk(kernel, inputs, outputs, interpret: bool):
  """`kernel` over the grid (rows x heads, chunks), each program given its chunk of every
  input and output whole (`_chunk_spec`); inputs [n, rows x heads, ...]."""
  n, rows = inputs[0].shape[:2]
  return pl.pallas_call(
      kernel, out_shape=outputs, grid=(rows, n), in_specs=[_chunk_spec(x) for x in inputs],
      out_specs=[_chunk_spec(x) for x in outputs], interpret=interpret,
      compiler_params=_triton_params(interpret),
  )(*inputs)


# The outputs over [n, rows x heads, ...] arrays; `precision` of the kernels' matmuls.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _outputs(q, k, g, states, v_new, precision, interpret: bool):
  n, rows, c, dv = v_new.shape
  block_v = min(OUTPUT_BLOCK_V, dv)
  if dv % block_v:
    raise ValueError(f"gdn_scan=fused: the value head dim {dv} is not a multiple of {block_v}")
  return pl.pallas_call(
      functools.partial(_output_kernel, precision=_in_kernel(precision, interpret)),
      out_shape=jax.ShapeDtypeStruct(v_new.shape, v_new.dtype), grid=(rows, n, dv // block_v),
      in_specs=[_chunk_spec(q), _chunk_spec(k), _chunk_spec(g), _chunk_spec(states, block_v),
                _chunk_spec(v_new, block_v)],
      out_specs=_chunk_spec(v_new, block_v), interpret=interpret,
      compiler_params=_triton_params(interpret),
  )(q, k, g, states, v_new)


def _outputs_forward(q, k, g, states, v_new, precision, interpret: bool):
  return _outputs(q, k, g, states, v_new, precision, interpret), (q, k, g, states, v_new)


def _outputs_backward(precision, interpret: bool, residuals, d_out):
  block_v = min(OUTPUT_BLOCK_V, residuals[-1].shape[-1])
  outputs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in residuals)
  kernel = functools.partial(_output_backward_kernel,
                             precision=_in_kernel(precision, interpret), block_v=block_v)
  return tuple(_per_chunk(kernel, residuals + (d_out,), outputs, interpret))


_outputs.defvjp(_outputs_forward, _outputs_backward)


def _outputs_local(q, k, g, states, v_new, precision, interpret: bool):
  """`chunk_outputs` on one device's rows and heads."""
  return _outputs(*_rows(q, k, g, states, v_new), precision, interpret).reshape(v_new.shape)


def _transform_local(k, v, g, beta, precision, interpret: bool):
  """`ut_transform` on one device's rows and heads."""
  u, w = _transform(*_rows(k, v, g, beta), precision, interpret)
  return u.reshape(v.shape), w.reshape(k.shape)


def _per_device(local, args, outputs: int):
  """`local` on args [n_chunks, batch, heads, ...], per device over the rows and heads
  (`common.per_device`); `outputs` results alike."""
  return common.per_device(local, args, (_CHUNKED,) * len(args),
                           _CHUNKED if outputs == 1 else (_CHUNKED,) * outputs)


def chunk_outputs(q, k, g, states, v_new, precision: str = "highest"):
  """Every chunk's output from its queries, keys, log decays, state and corrected values
  (comment above), one kernel forward and one backward.

  Args:
    q, k: [n_chunks, batch, heads, chunk, d_k] float32; g: [n_chunks, batch, heads, chunk].
    states: [n_chunks, batch, heads, d_k, d_v], the state before each chunk (`walk`).
    v_new: [n_chunks, batch, heads, chunk, d_v] (`walk`).
  Returns:
    [n_chunks, batch, heads, chunk, d_v] float32.
  """
  interpret = common.triton_interpret("gdn_scan=fused", "outputs or states")
  if not interpret:
    common.check_triton_dims("gdn_scan=fused", (
        ("the value block, min(OUTPUT_BLOCK_V, linear_value_head_dim)",
         min(OUTPUT_BLOCK_V, v_new.shape[4])),))
  local = functools.partial(_outputs_local, precision=jax.lax.Precision(precision),
                            interpret=interpret)
  return _per_device(local, (q, k, g, states, v_new), 1)


# The chunks' UT transform (`model.gdn_scan=fused`): with kb = k * beta, the strictly lower
# L = (kb k^T) * D and Y = (I + L)^-1, the walk's inputs are u = Y (v * beta) and
# w = Y (kb * e^G) (`gated_deltanet.chunked_delta_rule`). XLA wrote L, D, the pieces of Y's
# log-depth product and their gradients to memory; here one program a chunk holds them (the
# ~1B GRPO step for an H200: 822 -> 749 GiB a step, an estimate). Y is the series
# (I - L)(I + L^2)(I + L^4)... over the whole chunk (log2(c) - 1 squarings: Triton cannot cut a
# block into the halves `gated_deltanet._unit_lower_inverse` recurses on); L is nilpotent, so
# the product is exact. The gradient keeps Y.
def _inverse(strict_lower, dot):
  """(I + L)^-1 of one chunk's strictly lower-triangular L [c, c] (comment above)."""
  c = strict_lower.shape[0]
  eye = (jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
         == jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)).astype(jnp.float32)
  power = -strict_lower
  inverse = eye + power
  for _ in range(max(math.ceil(math.log2(c)) - 1, 0)):
    power = dot(power, power)
    inverse = inverse + dot(inverse, power)
  return inverse


def _transform_kernel(k_ref, v_ref, g_ref, beta_ref, u_ref, w_ref, *inverse_ref, precision):
  """Program (row x head, chunk): u_i, w_i, and (for the gradient) Y_i."""
  dot = functools.partial(jnp.dot, precision=precision)
  k, beta = _f32(k_ref[...]), beta_ref[...]
  decay, scale, (_, before) = _decays(g_ref[...])
  kb = k * beta[:, None]
  inverse = _inverse(jnp.where(before, dot(kb, k.T) * decay, 0.0), dot)
  if inverse_ref:
    inverse_ref[0][...] = inverse.astype(inverse_ref[0].dtype)
  u_ref[...] = dot(inverse, _f32(v_ref[...]) * beta[:, None]).astype(u_ref.dtype)
  w_ref[...] = dot(inverse, kb * scale[:, None]).astype(w_ref.dtype)


def _transform_backward_kernel(k_ref, v_ref, g_ref, beta_ref, inverse_ref, u_ref, w_ref,
                               d_u_ref, d_w_ref, d_k_ref, d_v_ref, d_g_ref, d_beta_ref, *,
                               precision):
  """Program (row x head, chunk): the gradients of u_i and w_i. From (I + L) X = R for X = u, w:
  R_bar = Y^T X_bar and L_bar = -(R_bar_u u^T + R_bar_w w^T), strictly lower (as
  `gated_deltanet._unit_lower_solve`'s); then through L = (kb k^T) * D, R_u = v * beta and
  R_w = kb * e^G to k, v, beta and the decays."""
  dot = functools.partial(jnp.dot, precision=precision)
  k, v, beta, inverse = _f32(k_ref[...]), _f32(v_ref[...]), beta_ref[...], _f32(inverse_ref[...])
  decay, scale, masks = _decays(g_ref[...])
  kb = k * beta[:, None]
  kbk = dot(kb, k.T)
  r_bar_u, r_bar_w = dot(inverse.T, _f32(d_u_ref[...])), dot(inverse.T, _f32(d_w_ref[...]))
  l_bar = -jnp.where(masks[1], dot(r_bar_u, _f32(u_ref[...]).T)
                     + dot(r_bar_w, _f32(w_ref[...]).T), 0.0)
  d_kbk = l_bar * decay
  d_kb = r_bar_w * scale[:, None] + dot(d_kbk, k)
  d_k_ref[...] = (d_kb * beta[:, None] + dot(d_kbk.T, kb)).astype(d_k_ref.dtype)
  d_v_ref[...] = (r_bar_u * beta[:, None]).astype(d_v_ref.dtype)
  d_beta_ref[...] = jnp.sum(r_bar_u * v, axis=1) + jnp.sum(d_kb * k, axis=1)
  d_g_ref[...] = _decays_backward(d_kbk * kbk, jnp.sum(r_bar_w * kb * scale[:, None], axis=1),
                                  masks)


def _transform_call(k, v, g, beta, precision, interpret: bool, keep_inverse: bool):
  n, rows, c = g.shape
  like = lambda x, shape=None: jax.ShapeDtypeStruct(shape or x.shape, x.dtype)
  outputs = (like(v), like(k)) + ((like(k, (n, rows, c, c)),) if keep_inverse else ())
  kernel = functools.partial(_transform_kernel, precision=_in_kernel(precision, interpret))
  return _per_chunk(kernel, (k, v, g, beta), outputs, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _transform(k, v, g, beta, precision, interpret: bool):
  return tuple(_transform_call(k, v, g, beta, precision, interpret, keep_inverse=False))


def _transform_forward(k, v, g, beta, precision, interpret: bool):
  u, w, inverse = _transform_call(k, v, g, beta, precision, interpret, keep_inverse=True)
  return (u, w), (k, v, g, beta, inverse, u, w)


def _transform_backward(precision, interpret: bool, residuals, cotangents):
  outputs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in residuals[:4])
  kernel = functools.partial(_transform_backward_kernel,
                             precision=_in_kernel(precision, interpret))
  return tuple(_per_chunk(kernel, residuals + tuple(cotangents), outputs, interpret))


_transform.defvjp(_transform_forward, _transform_backward)


def ut_transform(k, v, g, beta, precision: str = "highest"):
  """Every chunk's u and w, the walk's inputs (comment above), one kernel forward and one
  backward.

  Args:
    k: [n_chunks, batch, heads, chunk, d_k] float32; v: [n_chunks, batch, heads, chunk, d_v];
    g, beta: [n_chunks, batch, heads, chunk] the log decays and write strengths.
  Returns:
    (u [n_chunks, batch, heads, chunk, d_v], w [n_chunks, batch, heads, chunk, d_k]).
  """
  interpret = common.triton_interpret("gdn_scan=fused", "outputs or states")
  if not interpret:
    common.check_triton_dims("gdn_scan=fused", (
        ("gdn_chunk_size", g.shape[3]), ("linear_key_head_dim", k.shape[4]),
        ("linear_value_head_dim", v.shape[4])))
  local = functools.partial(_transform_local, precision=jax.lax.Precision(precision),
                            interpret=interpret)
  return _per_device(local, (k, v, g, beta), 2)


# A decode step's Gated DeltaNet mixer after its conv (`model.gdn_decode=fused`): rows of the
# state a program holds at a time.
DECODE_BLOCK_V = 32


def _decode_kernel(layer_ref, q_ref, k_ref, v_ref, gates_ref, live_ref, a_log_ref, dt_bias_ref,
                   norm_ref, s_ref, out_ref, s_out_ref, *, block_v: int, group: int, eps: float):
  """Program (row, value head): the token's mixer, from the conv's outputs to the gated norm.
  The key (q, k: key head h // group) normalised, the gates from their projections, then the
  state S^T ([d_v, d_k]) `block_v` rows at a time, each block read once and written once in
  place (`s_out_ref` is `s_ref`'s buffer), and the output's gated RMS norm over all d_v, in
  the dtypes and roundings of XLA's step (`gated_deltanet._mix`)."""
  r, h = pl.program_id(0), pl.program_id(1)
  layer, hk = layer_ref[0], h // group
  unit = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x) + 1e-6)        # gated_deltanet._l2norm
  q = unit(_f32(q_ref[r, hk, :])) * (q_ref.shape[-1] ** -0.5)        # [d_k]
  k = unit(_f32(k_ref[r, hk, :]))
  live, dv = live_ref[r], v_ref.shape[-1]
  beta = live / (1.0 + jnp.exp(-_f32(gates_ref[r, h, dv])))          # sigmoid
  x = _f32(gates_ref[r, h, dv + 1]) + _f32(dt_bias_ref[h])
  softplus = jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))
  decay = jnp.exp(-jnp.exp(_f32(a_log_ref[h])) * softplus * live)
  outs = []
  for j in range(dv // block_v):
    rows = pl.ds(j * block_v, block_v)
    s = s_ref[layer, r, h, rows, :] * decay                           # [block_v, d_k]
    predicted = jnp.sum(s * k[None, :], axis=1)                       # [block_v]
    s = s + ((_f32(v_ref[r, h, rows]) - predicted) * beta)[:, None] * k[None, :]
    s_out_ref[layer, r, h, rows, :] = s
    outs.append(jnp.sum(s * q[None, :], axis=1).astype(out_ref.dtype).astype(jnp.float32))
  # norm.gated_rms_norm: normalised in float32, rounded, scaled in the activation dtype, gated.
  dt = out_ref.dtype
  inv = jax.lax.rsqrt(sum(jnp.sum(o * o) for o in outs) / dv + eps)
  for j, o in enumerate(outs):
    rows = pl.ds(j * block_v, block_v)
    normed = (_f32(norm_ref[rows].astype(dt)) * _f32((o * inv).astype(dt))).astype(dt)
    gate = _f32(gates_ref[r, h, rows])
    out_ref[r, h, rows] = (_f32(normed) * (gate / (1.0 + jnp.exp(-gate)))).astype(dt)


def _decode_local(q, k, v, gates, live, a_log, dt_bias, norm_w, state, layer, eps: float,
                  interpret: bool):
  """`recurrent_step` on one device's rows and heads (state stacked [L, b, h, d_v, d_k])."""
  b, h, dv = v.shape
  block_v = min(DECODE_BLOCK_V, dv)
  kernel = functools.partial(_decode_kernel, block_v=block_v, group=h // q.shape[1], eps=eps)
  whole = pl.no_block_spec
  out, state = pl.pallas_call(
      kernel, grid=(b, h), in_specs=[whole] * 10, out_specs=[whole, whole],
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct(state.shape, state.dtype)],
      input_output_aliases={9: 1}, interpret=interpret,
      compiler_params=None if interpret else pl_triton.CompilerParams(num_warps=NUM_WARPS,
                                                                      num_stages=1),
  )(layer, q, k, v, gates, live, a_log, dt_bias, norm_w, state)
  return out, state


def recurrent_step(q, k, v, gates, live, params, state, layer=None, eps: float = 1e-6):
  """One token of a Gated DeltaNet layer's mixer after its conv, one kernel: what
  `gated_deltanet._mix` does there with XLA's kernels (q and k normalised and q scaled, the
  gates beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias), the delta rule's step
  `recurrent_delta_rule` with t = 1, the output's `norm.gated_rms_norm` by z). Each program
  reads its (row, head)'s state once, updates it with the token's key and value, reads the
  output from it and writes it back in place.

  Args:
    q, k: [batch, key heads, d_k] the conv's outputs (value head i reads key head i // (value
      heads / key heads)); v: [batch, heads, d_v] the conv's v; gates: [batch, heads, d_v + 2]
      each head's projections z (d_v), b and a, one array (XLA writes it as one kernel from
      its merged projection, three as slices); live: [batch] float32, 1 for a row that takes
      the token and 0 for one whose state stays (g = beta = 0).
    params: the layer's {"A_log": [heads], "dt_bias": [heads], "norm": [d_v]}.
    state: [batch, heads, d_v, d_k] float32 (S transposed, the cache's layout), or every
      layer's stacked [L, batch, heads, d_v, d_k] with `layer` (int32) the one to update.
  Returns:
    (out [batch, heads, d_v] in v's dtype, gated and normed; the state, stacked if it came
    stacked, updated in place).
  """
  interpret = common.triton_interpret("gdn_decode=fused", "xla")
  dv, dk = state.shape[-2:]
  if not interpret:
    common.check_triton_dims("gdn_decode=fused", (
        ("linear_key_head_dim", dk),
        ("the value block, min(DECODE_BLOCK_V, linear_value_head_dim)", min(DECODE_BLOCK_V, dv)),
        ("linear_value_head_dim", dv)))
  stacked = layer is not None
  if not stacked:
    state, layer = state[None], 0
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  live = jnp.asarray(live, jnp.float32)
  local = functools.partial(_decode_local, eps=eps, interpret=interpret)
  heads = ("activation_heads",)
  out, state = common.per_device(
      local, (q, k, v, gates, live, params["A_log"], params["dt_bias"], params["norm"], state,
              layer),
      (_ROWS_HEADS,) * 4 + (("batch",), heads, heads, (), _STACKED, ()),
      (_ROWS_HEADS, _STACKED))
  return out, (state if stacked else state[0])
