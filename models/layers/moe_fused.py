"""The blocked MoE's expert matmuls as one GPU kernel each (`model.moe_dispatch=blocked_fused`).

The blocked dispatch (models/layers/moe.py) lays the routed rows out in blocks of one expert
each and multiplies every block by its expert's matrix. In XLA that is a gather of every block's
expert matrix ([blocks, d_in, d_out], a copy) and a batched matmul over it: each matrix is read,
written and read again per block. A decode step of the ~1B benchmark model at 128 sequences
has 112 blocks a layer (4 rows each), 252 MiB of gathered matrices a layer against the ~141 MiB
its ~63 distinct experts hold (docs/results.md).

Here one Triton kernel (Pallas) reads each block's expert matrix where it lies: one program per
(block, column tile of d_out) walks d_in in tiles, `xs[block] @ w[layer, expert of block]`,
float32 accumulation; blocks past `used_blocks` (the layout's padding) write zeros without
reading. Blocks of fewer than 16 rows (decode) are padded to Triton's 16. The weights may be
every layer's stack with the layer's index (the decode step passes them so: a kernel's operand
that is a slice of the layer scan's stacked weights would be copied out whole first), or one
layer's. The gradient is the blocked matmul's own (`moe._expert_matmul_bwd`): only the forward
is the kernel, so training keeps the gather in its backward pass.

On CPU Pallas' interpreter runs the kernel (the tests); TPU has its own grouped matmul (`gmm`):
`blocked_fused` is an error there. On a mesh the MoE runs it per device (`moe._routed_sharded`).
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


def _kernel(layer_ref, expert_ref, used_ref, x_ref, w_ref, o_ref, *, tile_in: int,
            tile_out: int, d_in: int):
  """Program (block, j): o [rows, tile_out] = x [rows, d_in] @ w[layer, expert, :, j-th tile]."""
  block, j = pl.program_id(0), pl.program_id(1)
  layer, expert = layer_ref[0], expert_ref[block]
  steps = jnp.where(block < used_ref[0], jnp.int32(d_in // tile_in), jnp.int32(0))

  def step(i, acc):
    x = x_ref[:, pl.ds(i * tile_in, tile_in)]
    w = w_ref[layer, expert, pl.ds(i * tile_in, tile_in), pl.ds(j * tile_out, tile_out)]
    return acc + jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def block_matmul(xs, w, block_expert, used_blocks=None, layer=None):
  """xs [blocks, rows, d_in] @ w[block_expert] (w [experts, d_in, d_out], or every layer's
  [layers, experts, d_in, d_out] with `layer` its index) -> [blocks, rows, d_out] in xs's dtype
  (w's tiles are cast to it); blocks from `used_blocks` on (a traced count; None: none) are
  zeros."""
  interpret = common.triton_interpret("moe_dispatch=blocked_fused", "gmm or blocked")
  if layer is None:
    w, layer = w[None], 0
  blocks, rows, d_in = xs.shape
  d_out = w.shape[-1]
  tile_in, tile_out = _tile(d_in, TILE_IN), _tile(d_out, TILE_OUT)
  if not interpret and min(tile_in, tile_out) < 16:
    raise ValueError("model.moe_dispatch=blocked_fused on GPU needs hidden_size and "
                     "moe_intermediate_size multiples of 16, got "
                     f"{d_in} and {d_out} (the matrix's d_in, d_out)")
  padded = max(TRITON_ROWS, rows)
  if padded != rows:
    xs = jnp.pad(xs, [(0, 0), (0, padded - rows), (0, 0)])
  used = jnp.asarray(blocks if used_blocks is None else used_blocks, jnp.int32).reshape(1)
  kernel = functools.partial(_kernel, tile_in=tile_in, tile_out=tile_out, d_in=d_in)
  out = pl.pallas_call(
      kernel, grid=(blocks, d_out // tile_out),
      in_specs=[pl.no_block_spec, pl.no_block_spec, pl.no_block_spec,
                pl.BlockSpec((None, padded, d_in), lambda b, j: (b, 0, 0)),
                pl.no_block_spec],                 # w: the kernel indexes its expert itself
      out_specs=pl.BlockSpec((None, padded, tile_out), lambda b, j: (b, 0, j)),
      out_shape=jax.ShapeDtypeStruct((blocks, padded, d_out), xs.dtype),
      interpret=interpret,
      compiler_params=None if interpret else pl_triton.CompilerParams(num_warps=NUM_WARPS,
                                                                      num_stages=2),
  )(jnp.asarray(layer, jnp.int32).reshape(1), block_expert.astype(jnp.int32), used, xs, w)
  return out[:, :rows]
