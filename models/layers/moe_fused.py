"""The blocked MoE's expert matmuls as one GPU kernel each (`model.moe_dispatch=blocked_fused`).

The blocked dispatch (models/layers/moe.py) lays the routed rows out in blocks of one expert
each and multiplies every block by its expert's matrix. In XLA that is a gather of every block's
expert matrix ([blocks, d_in, d_out], a copy) and a batched matmul over it: each matrix is read,
written and read again per block. A decode step of the ~1B benchmark model at 128 sequences
has 112 blocks a layer (4 rows each), 252 MiB of gathered matrices a layer against the ~141 MiB
its ~63 distinct experts hold (docs/results.md).

Here one Triton kernel (Pallas) reads each block's expert matrix where it lies: one program per
(block, column tile of d_out) walks d_in in tiles, `xs[block] @ w[layer, expert of block]`,
float32 accumulation; blocks past `used_blocks` (the layout's padding) or of expert -1 (a
decode step's pair of another device's expert) write zeros without reading. Blocks of 2 to 15
rows are padded to the 16 Triton's dot takes; a block of one row (a decode step's pair) is
products and a sum instead, unpadded. The weights may be
every layer's stack with the layer's index (the decode step passes them so: a kernel's operand
that is a slice of the layer scan's stacked weights would be copied out whole first), or one
layer's.

The backward is two more kernels, so training gathers no expert matrix either: the input
gradient is the same kernel against each block's matrix transposed (`transpose=True`), and the
weight gradient (`expert_weight_grads`) one program per (expert, tile of w) summing x^T dy over
that expert's blocks in float32, which the blocked layout keeps contiguous (its block experts
are non-decreasing). XLA's form of that gradient writes each block's [d_in, d_out] product and
scatter-adds it into its expert: at the 35B-A3B shape and 16,384 tokens a micro-batch, ~1,300
blocks of 2 MiB a matrix, read and written several times a layer.

A decode step (inference) has two more: the gate and up matmuls with silu(gate) * up in one
(`block_swiglu`), and the routing, router matmul to top-k weights, in one (`route`).

On CPU Pallas' interpreter runs the kernels (the tests); TPU has its own grouped matmul (`gmm`):
`blocked_fused` is an error there. On a mesh the MoE runs them per device (`moe._routed_sharded`).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from models.layers import common

TRITON_ROWS = 16
NUM_WARPS = 4
# Tiles of d_in walked and of d_out a program writes (the largest powers of two up to these
# that divide the dimension). Chosen from Triton's usual GEMM tiles, not timed (no GPU run).
TILE_IN = 64
TILE_OUT = 128


def _tile(dim: int, most: int) -> int:
  t = most
  while t > 1 and dim % t:
    t //= 2
  return t


def _product(x, w, transpose: bool):
  """x [rows, tile_in] @ w [tile_in, tile_out] (`transpose`: @ w [tile_out, tile_in]^T) in
  float32; w cast to x's dtype first."""
  w = w.astype(x.dtype)
  if x.shape[0] == 1:
    # One row (a decode step's pair): products and a sum, as Triton's dot takes >= 16 rows.
    x32, w32 = x[0].astype(jnp.float32), w.astype(jnp.float32)
    return (jnp.sum(x32[None, :] * w32, axis=1) if transpose
            else jnp.sum(x32[:, None] * w32, axis=0))[None, :]
  if transpose:
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _walk(layer_ref, expert_ref, used_ref, x_ref, w_refs, shape, *, tile_in: int,
          tile_out: int, d_in: int, transpose: bool):
  """Program (block, j)'s float32 products x [rows, d_in] @ w[layer, expert, :, j-th tile] of
  each of `w_refs` (`transpose`: @ w[layer, expert, j-th tile, :]^T), walking d_in in tiles;
  zeros for a padding block or one of expert -1, read from nothing."""
  block, j = pl.program_id(0), pl.program_id(1)
  layer, expert = layer_ref[0], expert_ref[block]
  live = (block < used_ref[0]) & (expert >= 0)
  steps = jnp.where(live, jnp.int32(d_in // tile_in), jnp.int32(0))
  expert = jnp.maximum(expert, 0)
  out_tile, in_tile = pl.ds(j * tile_out, tile_out), lambda i: pl.ds(i * tile_in, tile_in)

  def step(i, accs):
    x = x_ref[:, in_tile(i)]
    ws = [w_ref[layer, expert, out_tile, in_tile(i)] if transpose
          else w_ref[layer, expert, in_tile(i), out_tile] for w_ref in w_refs]
    return tuple(acc + _product(x, w, transpose) for acc, w in zip(accs, ws))

  zeros = tuple(jnp.zeros(shape, jnp.float32) for _ in w_refs)
  return jax.lax.fori_loop(0, steps, step, zeros)


def _kernel(layer_ref, expert_ref, used_ref, x_ref, w_ref, o_ref, **walk):
  """Program (block, j): o [rows, tile_out] = x [rows, d_in] @ w[layer, expert, :, j-th tile]
  (`transpose`: @ w[layer, expert, j-th tile, :]^T)."""
  (acc,) = _walk(layer_ref, expert_ref, used_ref, x_ref, (w_ref,), o_ref.shape, **walk)
  o_ref[...] = acc.astype(o_ref.dtype)


def _swiglu_kernel(layer_ref, expert_ref, used_ref, x_ref, wg_ref, wu_ref, o_ref, **walk):
  """Program (block, j): o = silu(x @ wg) * (x @ wu) on the j-th tile of the expert's hidden
  units, both products rounded to o's dtype first as XLA's separate matmuls store them."""
  gate, up = _walk(layer_ref, expert_ref, used_ref, x_ref, (wg_ref, wu_ref), o_ref.shape, **walk)
  dt = o_ref.dtype
  gate, up = (a.astype(dt).astype(jnp.float32) for a in (gate, up))
  act = (gate / (1.0 + jnp.exp(-gate))).astype(dt).astype(jnp.float32)
  o_ref[...] = (act * up).astype(dt)


def _tiles(d_in: int, d_out: int, interpret: bool) -> tuple[int, int]:
  """(tile of d_in, tile of d_out); on GPU an error unless both are at least Triton's 16."""
  tile_in, tile_out = _tile(d_in, TILE_IN), _tile(d_out, TILE_OUT)
  if not interpret and min(tile_in, tile_out) < 16:
    raise ValueError("model.moe_dispatch=blocked_fused on GPU needs hidden_size and "
                     f"moe_intermediate_size multiples of 16, got {d_in} and {d_out} (the matrix's d_in, "
                     "d_out)")
  return tile_in, tile_out


def _pad_rows(a, rows: int):
  """a [blocks, r, d] with zero rows up to `rows` (Triton's dots take at least 16)."""
  return a if a.shape[1] == rows else jnp.pad(a, [(0, 0), (0, rows - a.shape[1]), (0, 0)])


def _compiler_params(interpret: bool):
  return None if interpret else pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=2)


def _used(used_blocks, blocks: int):
  return jnp.asarray(blocks if used_blocks is None else used_blocks, jnp.int32).reshape(1)


def _blocks_call(kernel, xs, ws, block_expert, used_blocks, layer, d_out: int,
                 transpose: bool = False, x_every: int = 1):
  """`kernel` (`_kernel` or `_swiglu_kernel`) over xs [blocks / x_every, rows, d_in] (block b
  reads xs[b // x_every]) and the weights `ws` (every layer's [layers, experts, ...] with
  `layer`, else one layer's), one program per (block, tile of d_out): [blocks, rows, d_out] in
  xs's dtype, blocks = block_expert's length."""
  interpret = common.triton_interpret("moe_dispatch=blocked_fused", "gmm or blocked")
  if layer is None:
    ws, layer = [w[None] for w in ws], 0
  _, rows, d_in = xs.shape
  blocks = block_expert.shape[0]
  tile_in, tile_out = _tiles(d_in, d_out, interpret)
  padded = rows if rows == 1 else max(TRITON_ROWS, rows)
  kernel = functools.partial(kernel, tile_in=tile_in, tile_out=tile_out, d_in=d_in,
                             transpose=transpose)
  out = pl.pallas_call(
      kernel, grid=(blocks, d_out // tile_out),
      in_specs=[pl.no_block_spec, pl.no_block_spec, pl.no_block_spec,
                pl.BlockSpec((None, padded, d_in), lambda b, j: (b // x_every, 0, 0)),
                *[pl.no_block_spec] * len(ws)],    # w: the kernel indexes its expert itself
      out_specs=pl.BlockSpec((None, padded, tile_out), lambda b, j: (b, 0, j)),
      out_shape=jax.ShapeDtypeStruct((blocks, padded, d_out), xs.dtype),
      interpret=interpret, compiler_params=_compiler_params(interpret),
  )(jnp.asarray(layer, jnp.int32).reshape(1), block_expert.astype(jnp.int32),
    _used(used_blocks, blocks), _pad_rows(xs, padded), *ws)
  return out[:, :rows]


def block_matmul(xs, w, block_expert, used_blocks=None, layer=None, transpose=False):
  """xs [blocks, rows, d_in] @ w[block_expert] (w [experts, d_in, d_out], or every layer's
  [layers, experts, d_in, d_out] with `layer` its index) -> [blocks, rows, d_out] in xs's dtype
  (w's tiles are cast to it); blocks from `used_blocks` on (a traced count; None: none), and
  blocks whose expert is negative, are zeros, read nothing. `transpose`: xs @ w[block_expert]^T,
  w [experts, d_out, d_in] (the input gradient)."""
  d_out = w.shape[-2] if transpose else w.shape[-1]
  return _blocks_call(_kernel, xs, [w], block_expert, used_blocks, layer, d_out, transpose)


def block_swiglu(xs, w_gate, w_up, block_expert, used_blocks=None, layer=None, x_every=1):
  """silu(xs @ w_gate[block_expert]) * (xs @ w_up[block_expert]) in one kernel (inference: no
  gradient is defined), where `block_matmul` twice and XLA's product are three kernels and
  write both products: xs [blocks, rows, d_in], the weights as `block_matmul`'s ->
  [blocks, rows, d_ff] in xs's dtype, with the roundings of the three. `x_every`: xs holds
  one block for every `x_every` (block b reads xs[b // x_every]: a decode step's k pairs of a
  token read its row, not k copies of it)."""
  return _blocks_call(_swiglu_kernel, xs, [w_gate, w_up], block_expert, used_blocks, layer,
                      w_gate.shape[-1], x_every=x_every)


def _wgrad_kernel(start_ref, end_ref, x_ref, dy_ref, o_ref, *, tile_in: int, tile_out: int):
  """Program (i, j, expert): o [tile_in, tile_out] = sum over the expert's blocks b of
  x[b, :, i-th tile]^T @ dy[b, :, j-th tile], in float32. The expert is the grid's slowest
  axis, so the programs running together share one expert's rows (held in L2 across tiles)."""
  i, j, e = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  def step(b, acc):
    x = x_ref[b, :, pl.ds(i * tile_in, tile_in)]
    dy = dy_ref[b, :, pl.ds(j * tile_out, tile_out)]
    return acc + jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(start_ref[e], end_ref[e], step, jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def expert_block_ranges(block_expert, num_experts: int, used_blocks=None):
  """block_expert int [blocks], non-decreasing -> (first block, end) of each expert [E] each,
  the blocks from `used_blocks` on (padding) in none: a compare-and-count, no search loop."""
  used = _used(used_blocks, block_expert.shape[0])[0]
  ends = jnp.sum(block_expert[None, :] <= jnp.arange(num_experts, dtype=jnp.int32)[:, None],
                 axis=1, dtype=jnp.int32)
  ends = jnp.minimum(ends, used)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def expert_weight_grads(xs, dy, block_expert, num_experts: int, used_blocks=None,
                        dtype=jnp.float32):
  """xs [blocks, rows, d_in], dy [blocks, rows, d_out] -> [num_experts, d_in, d_out] in
  `dtype`: each expert's sum of its blocks' x^T dy (block_expert non-decreasing, as the blocked
  layout makes it; blocks from `used_blocks` on are left out; an expert with no block gets
  zeros). The sum is float32 in one program either way, rounded once to `dtype` as it is
  stored: a bfloat16 gradient is written as such, not as float32 then converted (a third of the
  bytes)."""
  interpret = common.triton_interpret("moe_dispatch=blocked_fused", "gmm or blocked")
  _, rows, d_in = xs.shape
  d_out = dy.shape[-1]
  tile_in, tile_out = _tiles(d_in, d_out, interpret)
  padded = max(TRITON_ROWS, rows)
  starts, ends = expert_block_ranges(block_expert.astype(jnp.int32), num_experts, used_blocks)
  kernel = functools.partial(_wgrad_kernel, tile_in=tile_in, tile_out=tile_out)
  return pl.pallas_call(
      kernel, grid=(d_in // tile_in, d_out // tile_out, num_experts),
      in_specs=[pl.no_block_spec] * 4,               # the kernel walks its expert's blocks
      out_specs=pl.BlockSpec((None, tile_in, tile_out), lambda i, j, e: (e, i, j)),
      out_shape=jax.ShapeDtypeStruct((num_experts, d_in, d_out), dtype),
      interpret=interpret, compiler_params=_compiler_params(interpret),
  )(starts, ends, _pad_rows(xs, padded), _pad_rows(dy, padded))


# Rows of the router's matrix a decode step's routing kernel reads a step of its walk.
ROUTE_TILE = 64


def _route_kernel(layer_ref, x_ref, w_ref, logits_ref, weights_ref, ids_ref, *, k: int,
                  norm: bool, tile: int):
  """Program r (a token): its router logits x[r] @ w[layer] in float32, their softmax, the top k
  by k max passes (ties to the lower index, as `lax.top_k`), the picks' weights (normalised to
  sum to 1 with `norm`) and expert ids, padded with zeros to the outputs' width."""
  r, layer = pl.program_id(0), layer_ref[0]
  _, d_in, experts = w_ref.shape

  def step(i, acc):
    x = x_ref[r, pl.ds(i * tile, tile)].astype(jnp.float32)
    w = w_ref[layer, pl.ds(i * tile, tile), :].astype(jnp.float32)
    return acc + jnp.sum(x[:, None] * w, axis=0)

  logits = jax.lax.fori_loop(0, d_in // tile, step, jnp.zeros((experts,), jnp.float32))
  logits_ref[r, :] = logits
  probs = jnp.exp(logits - jnp.max(logits))
  probs = probs / jnp.sum(probs)
  expert = jnp.arange(experts, dtype=jnp.int32)
  slot = jnp.arange(weights_ref.shape[-1], dtype=jnp.int32)
  vals, ids, rest = jnp.zeros(slot.shape, jnp.float32), jnp.zeros(slot.shape, jnp.int32), probs
  for i in range(k):
    best = jnp.max(rest)
    # The lowest index holding the max; where NaN matched none, the last expert (in range).
    pick = jnp.minimum(jnp.min(jnp.where(rest == best, expert, experts)), experts - 1)
    vals = jnp.where(slot == i, best, vals)
    ids = jnp.where(slot == i, pick, ids)
    rest = jnp.where(expert == pick, -jnp.inf, rest)
  weights_ref[r, :] = vals / jnp.sum(vals) if norm else vals
  ids_ref[r, :] = ids


def route(x, router_w, k: int, norm: bool, layer=None):
  """A decode step's routing in one kernel, where XLA's is four (the router's matmul, the
  top-k's two passes, the weights' normalisation): x [tokens, embed] -> (router logits
  [tokens, experts] float32, weights [tokens, k] float32, expert ids [tokens, k] int32), as
  `moe.route` (logits from x and the router's matrix in float32, softmax, top k, weights
  normalised to sum to 1 with `norm`). router_w [embed, experts], or every layer's [layers,
  embed, experts] with `layer` its index (read in place: a layer scan's slice would be copied
  out first). Inference: no gradient is defined. Where `routes_in_one_kernel` is false,
  `moe.route` is XLA's."""
  interpret = common.triton_interpret("moe_dispatch=blocked_fused", "gmm or blocked")
  if layer is None:
    router_w, layer = router_w[None], 0
  n, d_in = x.shape
  experts = router_w.shape[-1]
  tile = _tile(d_in, ROUTE_TILE)
  width = 1 << (k - 1).bit_length()                  # Triton's blocks: powers of two
  logits, weights, ids = pl.pallas_call(
      functools.partial(_route_kernel, k=k, norm=norm, tile=tile), grid=(n,),
      in_specs=[pl.no_block_spec] * 3,
      out_specs=[pl.no_block_spec] * 3,
      out_shape=[jax.ShapeDtypeStruct((n, experts), jnp.float32),
                 jax.ShapeDtypeStruct((n, width), jnp.float32),
                 jax.ShapeDtypeStruct((n, width), jnp.int32)],
      interpret=interpret, compiler_params=_compiler_params(interpret),
  )(jnp.asarray(layer, jnp.int32).reshape(1), x, router_w)
  return logits, weights[:, :k], ids[:, :k]


def routes_in_one_kernel(num_experts: int, hidden_size: int) -> bool:
  """Whether `route`'s kernel takes these sizes: Triton's blocks are powers of two (the experts,
  and a tile of the hidden size of at least 16)."""
  return num_experts & (num_experts - 1) == 0 and _tile(hidden_size, ROUTE_TILE) >= 16
