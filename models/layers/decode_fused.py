"""One decode step's attention over the KV cache as one GPU kernel (`model.decode_attention=fused`).

A decoded token attends to its row's cached positions [0, pos) and to itself. The XLA form
(`attention._attend_cached`) walks the cache in blocks of 2,048 positions, and XLA:GPU copies
each block of keys and of values out of the stacked cache before reading it (its matmul and
reduction kernels take no dynamic slice of a loop-carried buffer): every cached byte is read,
written and read again, and a step reads up to the longest row's length for every row.

Here one Triton kernel (Pallas) reads the blocks where they lie, each once, and each row only
as far as its own `pos` (flash decoding): one program per (row, kv head, split) walks the blocks
`split, split + splits, ...` of its row with an online softmax in float32, and its query heads
(the kv head's group, padded to Triton's 16 rows) meet each block as two matmuls. The splits
spread a long row over several programs; their partial sums, and the token's own key and value,
are combined after the kernel:

    M = max(m_own, m_1..m_n);   out = (v_own e^(m_own - M) + sum_j o_j e^(m_j - M))
                                      / (e^(m_own - M) + sum_j l_j e^(m_j - M))

with m_j, l_j, o_j a split's running max, sum of exp(score - m_j) and its exp-weighted values.

On CPU Pallas' interpreter runs the same kernel (the tests); TPU has none (Pallas for TPU is
another kernel language): `fused` is an error there. On a mesh it runs per device over its rows
and kv heads (`common.per_device`); a cache split along its positions is an error.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from models import sharding
from models.layers import common

# Rows of a Triton matmul: the kv head's query heads are padded to at least this many.
TRITON_ROWS = 16
NUM_WARPS = 4
# Programs to aim for on one device, across rows, kv heads and splits: about two for each of an
# H200's 132 streaming multiprocessors. Chosen, not timed (no GPU run yet).
TARGET_PROGRAMS = 264
MAX_SPLITS = 32


def block_positions(head_dim: int) -> int:
  """Cached positions a program reads a step: a [block, head_dim] 16-bit tile of keys and one
  of values, 32 KiB each at head_dim 256 (chosen from the shared-memory budget, not timed)."""
  return 128 if head_dim <= 128 else 64


def num_splits(rows: int, kv_heads: int) -> int:
  """Splits of each row's positions: a power of two, enough programs for the device."""
  n = 1
  while n < MAX_SPLITS and rows * kv_heads * n < TARGET_PROGRAMS:
    n *= 2
  return n


def _kernel(layer_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block: int,
            splits: int, scale: float, max_len: int, precision):
  """One program: row `pid 0`, kv head `pid 1`, the blocks `pid 2 + splits * t` of that row.

  q_ref [G, hd] (the kv head's query heads); k_ref, v_ref the whole stacked cache [layers,
  rows, max_len, kv, hd]; o_ref [G, hd], m_ref, l_ref [G] the split's partial sums."""
  row, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer = layer_ref[0]
  cached = jnp.minimum(pos_ref[row], max_len)
  q = q_ref[...]
  blocks = (cached + block - 1) // block
  trips = (jnp.maximum(blocks - split, 0) + splits - 1) // splits

  def step(t, carry):
    acc, m, total = carry
    start = (split + t * splits) * block
    at = start + jnp.arange(block)
    seen = at < cached                                         # >= 1 position: start < cached
    where = (layer, row, pl.ds(start, block), head, slice(None))
    k = pl_triton.load(k_ref.at[where], mask=seen[:, None], other=0)         # [block, hd]
    s = jnp.dot(q, k.astype(q.dtype).T, precision=precision,
                preferred_element_type=jnp.float32) * scale                    # [G, block]
    s = jnp.where(seen[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_new[:, None])
    rescale = jnp.exp(m - m_new)
    v = pl_triton.load(v_ref.at[where], mask=seen[:, None], other=0)
    acc = acc * rescale[:, None] + jnp.dot(p.astype(q.dtype), v.astype(q.dtype),
                                           precision=precision,
                                           preferred_element_type=jnp.float32)
    return acc, m_new, total * rescale + p.sum(axis=1)

  g, hd = q.shape
  init = (jnp.zeros((g, hd), jnp.float32), jnp.full((g,), -jnp.inf, jnp.float32),
          jnp.zeros((g,), jnp.float32))
  acc, m, total = jax.lax.fori_loop(0, trips, step, init)
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = total


def _partials(q, k_cache, v_cache, pos, layer, interpret: bool):
  """The kernel over one device's rows: q [b, kv, G, hd] -> (o [b, kv, splits, G, hd], m, l
  [b, kv, splits, G]) float32."""
  b, nkv, g, hd = q.shape
  max_len = k_cache.shape[2]
  splits = num_splits(b, nkv)
  block = block_positions(hd)
  kernel = functools.partial(
      _kernel, block=block, splits=splits, scale=hd ** -0.5, max_len=max_len,
      precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
  whole = pl.no_block_spec   # the kernel indexes these itself
  per_split = lambda *tail: pl.BlockSpec((None, None, None) + tail,
                                         lambda r, h, j: (r, h, j) + (0,) * len(tail))
  f32 = jnp.float32
  return pl.pallas_call(
      kernel, grid=(b, nkv, splits),
      in_specs=[whole, whole, pl.BlockSpec((None, None, g, hd), lambda r, h, j: (r, h, 0, 0)),
                whole, whole],
      out_specs=[per_split(g, hd), per_split(g), per_split(g)],
      out_shape=[jax.ShapeDtypeStruct((b, nkv, splits, g, hd), f32),
                 jax.ShapeDtypeStruct((b, nkv, splits, g), f32),
                 jax.ShapeDtypeStruct((b, nkv, splits, g), f32)],
      interpret=interpret,
      compiler_params=None if interpret else pl_triton.CompilerParams(num_warps=NUM_WARPS,
                                                                      num_stages=2),
  )(layer, pos, q, k_cache, v_cache)


def _attend_local(q, k_cache, v_cache, own_k, own_v, pos, layer, interpret: bool):
  """`attend` on one device's rows and kv heads; k_cache, v_cache stacked [L, b, S, kv, hd]."""
  b, nh, hd = q.shape
  nkv = k_cache.shape[3]
  g = nh // nkv
  rows = max(TRITON_ROWS, 1 << (g - 1).bit_length())
  dtype = jnp.promote_types(q.dtype, k_cache.dtype)
  q = q.reshape(b, nkv, g, hd).astype(dtype)
  padded = jnp.pad(q, [(0, 0), (0, 0), (0, rows - g), (0, 0)])
  o, m, total = _partials(padded, k_cache, v_cache, pos, layer, interpret)
  o, m, total = o[:, :, :, :g], m[:, :, :, :g], total[:, :, :, :g]      # [b, kv, splits, g, ..]
  # The token's own key and value: its score is finite, so the max is too.
  m_own = jnp.einsum("bkgd,bkd->bkg", q.astype(jnp.float32), own_k.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST) * hd ** -0.5
  m_all = jnp.maximum(m_own, m.max(axis=2))
  w_own = jnp.exp(m_own - m_all)                                       # [b, kv, g]
  w = jnp.exp(m - m_all[:, :, None])                                   # [b, kv, splits, g]
  acc = w_own[..., None] * own_v.astype(jnp.float32)[:, :, None] + jnp.sum(w[..., None] * o, 2)
  denom = w_own + jnp.sum(w * total, axis=2)
  return (acc / denom[..., None]).reshape(b, nh, hd)


def attend(q, cache, new, pos, layer=None):
  """Softmax attention of one query per row over its cached keys [0, pos) and its own key.

  Args:
    q: [batch, heads, head_dim].
    cache: {"k", "v": [batch, max_len, kv_heads, head_dim]}, or stacked [layers, ...] with
      `layer` (an int32 index) the one to read, in place.
    new: {"k", "v": [batch, kv_heads, head_dim]}, the token's own.
    pos: [batch] int32, positions cached in each row.
  Returns:
    [batch, heads, head_dim] float32, as `attention._attend_cached`.
  """
  interpret = common.triton_interpret("decode_attention=fused", "xla")
  if not interpret:
    common.check_triton_dims("decode_attention=fused", (("head_dim", q.shape[-1]),))
  k_cache, v_cache = cache["k"], cache["v"]
  if layer is None:
    k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  local = functools.partial(_attend_local, interpret=interpret)
  on_mesh = common.kernel_mesh()
  if on_mesh is not None:
    mesh, rules = on_mesh
    length, = sharding.logical_to_spec(("activation_length",), rules, mesh, k_cache.shape[2:3])
    if length is not None and any(mesh.shape[a] > 1 for a in sharding.target_axes(length)):
      raise ValueError("model.decode_attention=fused reads each row's cache on one device; "
                       f"the cache's positions are split over {length}")
  # Per device over the rows and kv heads (a query head follows its kv head), whole positions.
  per_head, cache = ("batch", "kv_heads"), (None, "batch", None, "kv_heads")
  return common.per_device(local, (q, k_cache, v_cache, new["k"], new["v"], pos, layer),
                           (per_head, cache, cache, per_head, per_head, ("batch",), ()),
                           per_head)
