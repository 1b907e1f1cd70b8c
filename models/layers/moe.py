"""Feed-forward blocks: the sparse MoE with a shared expert, and the dense SwiGLU MLP.

MoE params (shapes with logical names):
  router         [embed, experts]             softmax -> top-k -> renormalise, in float32
  wi_gate, wi_up [experts, embed, expert_mlp]  routed SwiGLU experts
  wo             [experts, expert_mlp, embed]
  shared_gate_proj, shared_up_proj [embed, mlp]; shared_down_proj [mlp, embed]
  shared_expert_gate [embed]                  the shared expert is scaled by sigmoid(x . w)

Routing is dropless: the (token, slot) pairs are grouped by expert and no token is ever
dropped for capacity. The top-k and the blocked layout use no sort (`top_k`, `rank_in_group`).

On a device mesh the tokens are routed where they live: `forward` splits them into the groups
the mesh holds them in (one group per device of the batch and length axes: rows, and with
context parallelism the parts of a row) and sorts and dispatches each group on its own device
(`_routed_sharded`, a `shard_map`), so no sort or gather crosses devices and each device's
matmuls are over its own tokens' rows: the compiled FLOPs are those of the tokens, not of the
tokens times the devices. Either the expert weights are gathered whole for the layer (like
FSDP's weights, in the compute dtype; their `expert_mlp` split stays) and tokens never move,
the gradient of the gathered copy going back to each device's experts as one float32
reduce-scatter (`_gather_shards`), or, where `expert_parallel` says so, experts split over the
mesh stay split and the tokens move to them (expert parallelism). One group (no mesh, one
device) is the plain computation; `ragged_dot` always runs so. `cfg.moe_dispatch` picks how the
sorted rows meet the expert weights:
  ragged_dot  each expert's rows are one group of `jax.lax.ragged_dot`. XLA:CPU expands it to
              every row against every expert, so its cost grows with the number of experts.
  blocked     each expert's rows start at a block boundary and are padded to whole blocks of
              `block_size(...)` rows; every block belongs to one expert, whose weights are
              gathered per block ([blocks, embed, expert_mlp]) and applied by a batched
              matmul, `blocks_per_step` blocks at a time. Padding rows are zero and never read back, so results and gradients are
              those of the exact computation. Cost: rows <= n*k + min(E, n*k) * (block - 1).
  blocked_fused  `blocked`, each matmul one Triton kernel reading every block's expert
              matrix where it lies (`moe_fused.block_matmul`: no per-block copies), its
              backward two more (the input gradient, each expert's weight gradient summed
              over its blocks in float32). GPU (CPU interprets them; not TPU).
              A decode step hands it every layer's stacked experts and the layer's index
              (`forward`'s `layer`), so that not even the layer's slice is copied.
  gmm         each expert's rows against its weights by jax's grouped-matmul kernel for TPU
              (Pallas `megablox`): no per-block weight copies. On TPU only (elsewhere Pallas'
              interpreter runs it: tests), for widths that are multiples of 128 (`gmm_fits`).
  auto        per backend, `AUTO_DISPATCH`: `blocked` on cpu and gpu, `gmm` on tpu where it fits.
"""
import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from jax.sharding import PartitionSpec

from models import config as config_lib
from models import sharding
from models.config import ModelConfig
from models.layers import common
from models.layers import moe_fused


def init_mlp(key, hidden, inter, std, dt, prefix=""):
  kg, ku, kd = jax.random.split(key, 3)
  return {
      f"{prefix}gate_proj": common.normal(kg, (hidden, inter), std, dt),
      f"{prefix}up_proj": common.normal(ku, (hidden, inter), std, dt),
      f"{prefix}down_proj": common.normal(kd, (inter, hidden), std, dt),
  }


def mlp_axes(prefix=""):
  return {f"{prefix}gate_proj": ("embed", "mlp"), f"{prefix}up_proj": ("embed", "mlp"),
          f"{prefix}down_proj": ("mlp", "embed")}


def swiglu(p, x, dt, prefix=""):
  """Dense SwiGLU over x [..., embed]."""
  h = jax.nn.silu(common.dense(x, p[f"{prefix}gate_proj"], dt)) * common.dense(x, p[f"{prefix}up_proj"], dt)
  h = common.constrain(h, ("batch", "activation_length", "mlp")) if h.ndim == 3 else h
  return common.dense(h, p[f"{prefix}down_proj"], dt)


def init(key, cfg: ModelConfig) -> dict:
  h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  std, dt = cfg.initializer_range, cfg.jnp_param_dtype
  kr, kg, ku, kd, ks, ksg = jax.random.split(key, 6)
  p = {
      "router": common.normal(kr, (h, e), std, dt),
      "wi_gate": common.normal(kg, (e, h, i), std, dt),
      "wi_up": common.normal(ku, (e, h, i), std, dt),
      "wo": common.normal(kd, (e, i, h), std, dt),
  }
  if cfg.shared_expert_intermediate_size:
    p.update(init_mlp(ks, h, cfg.shared_expert_intermediate_size, std, dt, prefix="shared_"))
    p["shared_expert_gate"] = common.normal(ksg, (h,), std, dt)
  return p


def axes_of_experts() -> dict:
  """Logical axes of the routed experts' weights."""
  return {"wi_gate": ("experts", "embed", "expert_mlp"),
          "wi_up": ("experts", "embed", "expert_mlp"),
          "wo": ("experts", "expert_mlp", "embed")}


def axes(cfg: ModelConfig) -> dict:
  a = {"router": ("embed", "experts"), **axes_of_experts()}
  if cfg.shared_expert_intermediate_size:
    a.update(mlp_axes(prefix="shared_"))
    a["shared_expert_gate"] = ("embed",)
  return a


# `top_k` ranks every expert against every other (one pass) up to this many comparisons,
# tokens x experts^2: a decode step's tokens (the ~1B's 128 x 64^2, 35B-A3B's 256 x 256^2).
# Above it XLA:GPU's compile of the comparison grew to minutes (95 s at 1,024 tokens x 256^2)
# and XLA:CPU holds it whole, so a training step's tokens take k argmax passes.
TOP_K_RANK_MAX = 2**24


def top_k(probs, k: int):
  """`jax.lax.top_k` over the last axis without a sort: the same values and indices (in
  descending order, ties to the lower index). Compiled for a GPU without one at hand, XLA:GPU
  emits its own sort kernels (no CUB), whose code generation took most of a full-size step's
  compile. Up to `TOP_K_RANK_MAX` comparisons by rank (`_top_k_by_rank`: a few kernels where
  k argmax passes are about k, which a decode step, made of launches, feels: docs/results.md),
  else by k argmax passes (`_top_k_by_argmax`)."""
  experts = probs.shape[-1]
  if probs.size * experts <= TOP_K_RANK_MAX:
    return _top_k_by_rank(probs, k)
  return _top_k_by_argmax(probs, k)


def _top_k_by_argmax(probs, k: int):
  """k argmax passes, each masking the last one's pick: cheap beside the layer at any size."""
  vals, idxs = [], []
  rest = probs
  for _ in range(k):
    i = jnp.argmax(rest, axis=-1)
    vals.append(jnp.take_along_axis(probs, i[..., None], axis=-1)[..., 0])
    idxs.append(i.astype(jnp.int32))
    rest = jnp.where(jnp.arange(probs.shape[-1]) == i[..., None], -jnp.inf, rest)
  return jnp.stack(vals, -1), jnp.stack(idxs, -1)


def _top_k_by_rank(probs, k: int):
  """Each expert's rank, the experts ahead of it (a larger value, or an equal one at a lower
  index: a strict order, so the ranks are 0 .. E-1 once each), then the pick of rank r for r <
  k: its value and index reduced over the experts with that rank (one each)."""
  experts = probs.shape[-1]
  idx = jnp.arange(experts, dtype=jnp.int32)
  mine, other = probs[..., :, None], probs[..., None, :]
  ahead = (other > mine) | ((other == mine) & (idx[None, :] < idx[:, None]))
  rank = jnp.sum(ahead, axis=-1, dtype=jnp.int32)                       # [..., E]
  picked = rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # [..., k, E]
  vals = jnp.sum(jnp.where(picked, probs[..., None, :], 0), axis=-1)
  # A max, not a sum: where a NaN (which compares false both ways) left a rank to none or
  # several experts, the index is still one of them or 0.
  ids = jnp.max(jnp.where(picked, idx, 0), axis=-1)
  return vals.astype(probs.dtype), ids


# `rank_in_group` counts this many one-hot entries (rows x groups) a step of its loop.
RANK_STEP_ELEMENTS = 2**22


def rank_in_group(ids, num_groups: int):
  """ids int [n] in [0, num_groups) -> (each id's rank among the equal ids before it [n],
  the group sizes [num_groups]): a stable sort's positions within groups, without a sort
  (`top_k` says why): running one-hot counts, a loop over steps of rows."""
  n = ids.shape[0]
  step = max(1, min(n, RANK_STEP_ELEMENTS // (num_groups + 1)))
  pad = -n % step
  ids_s = jnp.pad(ids.astype(jnp.int32), (0, pad), constant_values=num_groups).reshape(-1, step)

  def one_step(counts, ids):
    within = jnp.cumsum(ids[:, None] == jnp.arange(num_groups + 1), axis=0, dtype=jnp.int32)
    rank = jnp.take_along_axis(within, ids[:, None], axis=1)[:, 0] - 1 + counts[ids]
    return counts + within[-1], rank

  counts, ranks = jax.lax.scan(one_step, jnp.zeros((num_groups + 1,), jnp.int32), ids_s)
  return ranks.reshape(-1)[:n], counts[:num_groups]


def route(router_w, x, cfg: ModelConfig, layer=None):
  """x [tokens, embed] -> (router logits [tokens, experts] f32, weights, expert ids [tokens, k]).
  `layer` (`blocked_fused` at inference): router_w is every layer's stack and this layer's
  index, and the routing one kernel where it takes the sizes (`moe_fused.route`; the same
  values)."""
  if layer is not None:
    if moe_fused.routes_in_one_kernel(cfg.num_experts, x.shape[-1]):
      return moe_fused.route(x, router_w, cfg.num_experts_per_tok, cfg.norm_topk_prob, layer)
    router_w = router_w[layer]
  logits = jnp.dot(x.astype(jnp.float32), router_w.astype(jnp.float32))
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = top_k(probs, cfg.num_experts_per_tok)
  if cfg.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return logits, weights, experts


DISPATCHES = config_lib.MOE_DISPATCHES

# What "auto" means on each backend (the platform being traced for). cpu: XLA:CPU has no
# ragged_dot kernel and computes every row against every expert, so its cost grows with the
# expert count; the blocked path is faster on the whole step (docs/model.md). gpu: XLA:GPU also
# rewrites ragged_dot into zero-padded dense matmuls; on an H200 the ~1B model's fwd+bwd ran
# slower with it than blocked (docs/results.md#one-h200). tpu: jax's grouped-matmul kernel
# (`gmm`), which reads each expert's weights once where the blocked layout copies them per
# block (the 35B-A3B step's temporaries on v5p: docs/results.md, compiler figures), where the
# widths allow its tiles (`gmm_fits`), else blocked.
AUTO_DISPATCH = {"cpu": "blocked", "gpu": "blocked", "cuda": "blocked", "rocm": "blocked",
                 "tpu": "gmm"}


def resolve_dispatch(dispatch: str, backend: str | None = None) -> str:
  """The concrete dispatch for `dispatch` on `backend` (default: the platform traced for)."""
  if dispatch not in DISPATCHES:
    raise ValueError(f"model.moe_dispatch must be one of {DISPATCHES}, got {dispatch!r}")
  if dispatch != "auto":
    return dispatch
  return AUTO_DISPATCH.get(backend or config_lib.platform(), "blocked")


def gmm_fits(cfg: ModelConfig) -> bool:
  """Whether the TPU grouped-matmul kernel can tile this model: its tiles are 128 wide, and
  Pallas on TPU takes a block that is a multiple of 128 or the whole dimension (in both the
  forward and the transposed backward), so hidden_size and moe_intermediate_size must be
  multiples of 128."""
  return cfg.hidden_size % 128 == 0 and cfg.moe_intermediate_size % 128 == 0


def dispatch_of(cfg: ModelConfig) -> str:
  """The dispatch `cfg` runs with: `resolve_dispatch`, with `auto`'s gmm falling back to blocked
  where `gmm_fits` does not hold; an explicit gmm there is an error on TPU."""
  dispatch = resolve_dispatch(cfg.moe_dispatch)
  if dispatch != "gmm" or gmm_fits(cfg) or config_lib.platform() != "tpu":
    return dispatch
  if cfg.moe_dispatch == "auto":
    return "blocked"
  raise ValueError(f"model.moe_dispatch='gmm' on TPU needs hidden_size and "
                   f"moe_intermediate_size multiples of 128, got {cfg.hidden_size} and "
                   f"{cfg.moe_intermediate_size}")


def block_size(num_pairs: int, num_experts: int, max_block: int) -> int:
  """Rows per expert block: `max_block`, or less when there are few rows per expert.

  The largest power of two <= max_block and <= num_pairs / min(num_experts, num_pairs), at
  least 1 (max_block itself if it is smaller). Then the padding, at most
  min(num_experts, num_pairs) * (block - 1) rows, stays under num_pairs: the matmul rows are
  fewer than 2 * num_pairs whatever the expert count (decode steps with few tokens included).
  """
  per_expert = max(1, num_pairs // max(1, min(num_experts, num_pairs)))
  b = 1
  while b * 2 <= per_expert:
    b *= 2
  return max(1, min(max_block, b))


def blocked_layout(experts, num_experts: int, block: int, first_expert=None):
  """Where each (token, slot) pair goes in the expert-blocked row layout.

  Args:
    experts: int [tokens, k] expert ids.
    num_experts: E, the experts laid out.
    block: rows per block.
    first_expert: None, or the id of the first of the E experts laid out (a device's share
      under expert parallelism): pairs routed to other experts get no row.

  Returns:
    pos_of_pair: int [tokens * k] row of each pair (in token-major order); `rows` (out of
      range) for a pair of another device's expert.
    row_token: int [rows] the token whose input each row holds (0 for padding rows).
    row_valid: bool [rows] False on padding rows.
    block_expert: int [blocks] the expert of each block, non-decreasing (padding-only blocks at
      the end get the last expert; their rows are zero).
    used_blocks: int scalar, the blocks holding rows (the rest are padding).
  The static row count is blocks * block with blocks = (n*k + min(E, n*k) * (block - 1)) // block,
  the most that sum_e ceil(group_e / block) can be.
  """
  n, k = experts.shape
  nk = n * k
  num_blocks = max(1, (nk + min(num_experts, nk) * (block - 1)) // block)
  rows = num_blocks * block
  flat = experts.reshape(-1).astype(jnp.int32)
  if first_expert is None:
    mine = None
  else:
    flat = flat - first_expert
    mine = (flat >= 0) & (flat < num_experts)
    flat = jnp.where(mine, flat, num_experts)                     # others: one more group
  rank, group_sizes = rank_in_group(flat, num_experts + (mine is not None))
  group_sizes = group_sizes[:num_experts]                         # pairs in order within experts
  group_blocks = (group_sizes + block - 1) // block
  block_ends = jnp.cumsum(group_blocks)                           # [E] first block after e
  padded_starts = (block_ends - group_blocks) * block
  pos_of_pair = padded_starts[jnp.minimum(flat, num_experts - 1)] + rank   # [nk] row of each pair
  if mine is not None:
    pos_of_pair = jnp.where(mine, pos_of_pair, rows)
  pair_token = jnp.arange(nk, dtype=jnp.int32) // k
  row_token = jnp.zeros((rows,), jnp.int32).at[pos_of_pair].set(pair_token, unique_indices=True,
                                                                mode="drop")
  row_valid = jnp.zeros((rows,), bool).at[pos_of_pair].set(True, unique_indices=True, mode="drop")
  # Every block against every expert's end at once (one fused compare-and-count; blocks x E is
  # small): the default binary search is a loop of log2(E) steps, each a few GPU kernels.
  block_expert = jnp.searchsorted(block_ends, jnp.arange(num_blocks, dtype=jnp.int32),
                                  side="right", method="compare_all")
  block_expert = jnp.minimum(block_expert, num_experts - 1).astype(jnp.int32)
  return pos_of_pair, row_token, row_valid, block_expert, block_ends[-1]


def _gather_blocks(w, block_expert):
  """w [experts, d_in, d_out] -> each block's expert's matrix [blocks, d_in, d_out]."""
  return w.at[block_expert].get(indices_are_sorted=True, mode="promise_in_bounds")


# `moe_block_chunk=-1` (auto): the blocked matmul gathers at most this many bytes of expert
# weights at a time. At full size one matrix's per-block copies are GiBs (35B-A3B, 2 rows of
# 10,240 tokens a device: 1,534 blocks x 2 MiB = 3 GiB a matrix, a dozen of them live in the
# step's backward on an H200 target; docs/model.md#moe-is-dropless-in-expert-blocks); below
# this the whole layout is one batched matmul, as on small models.
BLOCK_GATHER_BYTES = 256 * 2**20


def blocks_per_step(cfg: ModelConfig, blocks: int, w_shape, itemsize: int) -> int:
  """Blocks the blocked matmul takes a step (`cfg.moe_block_chunk`: >0 that many, 0 all,
  -1 as many as `BLOCK_GATHER_BYTES` of gathered weights hold), at most `blocks`."""
  if cfg.moe_block_chunk > 0:
    return min(cfg.moe_block_chunk, blocks)
  if cfg.moe_block_chunk == 0:
    return blocks
  per_block = math.prod(w_shape[1:]) * itemsize
  return max(1, min(blocks, BLOCK_GATHER_BYTES // per_block))


def _in_steps(step: int, xs, block_expert):
  """xs [blocks, ...], block_expert [blocks] -> [steps, step, ...], [steps, step]: padded to
  whole steps with zero rows of the last block's expert (the order stays non-decreasing)."""
  pad = -xs.shape[0] % step
  xs = jnp.pad(xs, [(0, pad)] + [(0, 0)] * (xs.ndim - 1))
  block_expert = jnp.concatenate([block_expert, jnp.repeat(block_expert[-1:], pad)])
  return xs.reshape(-1, step, *xs.shape[1:]), block_expert.reshape(-1, step)


def _steps_used(step: int, steps: int, used_blocks):
  """Steps of `step` blocks holding rows: all `steps`, or those up to `used_blocks`."""
  return steps if used_blocks is None else (used_blocks + step - 1) // step


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _expert_matmul(xs, w, block_expert, step, fused, used_blocks=None):
  """xs [blocks, block, d_in] @ w[block_expert] ([experts, d_in, d_out]) -> [blocks, block, d_out].

  The weights are gathered per block ([blocks, d_in, d_out]: about n*k/block + E expert
  matrices, i.e. d_out/block times the bytes of xs, plus one per expert) and applied by one
  batched matmul, `step` blocks at a time (a loop where step < blocks: the gathered copy is
  then step blocks' matrices, not the layout's). The loop stops after `used_blocks` (a traced
  count, optional): the blocks after it hold no row, their outputs are zero. The gradient
  (`_expert_matmul_bwd`) keeps only xs, w and the block experts: the gathered copy is not kept
  for the backward, which gathers again (memory-bound, 1/(2*block) of the matmul's work).
  A loop over experts would hold one expert's weights at a time, but a dropless one has
  data-dependent group sizes, so the loop is over fixed steps of blocks instead. `fused`: the
  forward and both gradients are kernels reading each block's matrix and rows in place
  (`moe_fused`: no loop, nothing gathered).
  """
  blocks = xs.shape[0]
  if fused:
    return moe_fused.block_matmul(xs, w, block_expert, used_blocks)
  if step >= blocks:
    return jnp.einsum("gbi,gio->gbo", xs, _gather_blocks(w, block_expert))
  xs_s, be_s = _in_steps(step, xs, block_expert)

  def one_step(i, ys):
    return ys.at[i].set(jnp.einsum("gbi,gio->gbo", xs_s[i], _gather_blocks(w, be_s[i])))

  ys = jnp.zeros(xs_s.shape[:3] + (w.shape[2],), xs.dtype)
  ys = jax.lax.fori_loop(0, _steps_used(step, xs_s.shape[0], used_blocks), one_step, ys)
  return ys.reshape(-1, *ys.shape[2:])[:blocks]


def _expert_matmul_fwd(xs, w, block_expert, step, fused, used_blocks=None):
  return (_expert_matmul(xs, w, block_expert, step, fused, used_blocks),
          (xs, w, block_expert, used_blocks))


def _block_grads(xs, dy, wb):
  """One step's input gradient (against its gathered weights wb) and its blocks' weight
  gradients, each block's x^T dy rounded once to xs's dtype."""
  return jnp.einsum("gbo,gio->gbi", dy, wb).astype(xs.dtype), jnp.einsum("gbi,gbo->gio", xs, dy)


def _expert_matmul_bwd(step, fused, res, dy):
  """The input gradient against the re-gathered weights; the weight gradient as each block's
  x^T dy (in xs's dtype: [blocks, d_in, d_out] in float32 would hold twice the bytes of the
  gathered weights), summed into its expert by a float32 scatter-add over the sorted block
  experts, then cast to w's dtype. Autodiff of the gather would scatter-add in w's dtype: with
  bfloat16 weights, 16-bit accumulation (a sum of many blocks then loses most of its bits),
  which XLA:GPU also runs several times slower than float32 (docs/results.md#one-h200).
  In steps of `step` blocks the float32 sum is the loop's carry. `fused`: two kernels, the
  input gradient against each block's matrix transposed and each expert's float32 sum of
  x^T dy over its blocks (models/layers/moe_fused.py): nothing gathered, no per-block products."""
  xs, w, block_expert, used_blocks = res
  blocks = xs.shape[0]
  if fused:
    dxs = moe_fused.block_matmul(dy, w, block_expert, used_blocks, transpose=True)
    dw = moe_fused.expert_weight_grads(xs, dy, block_expert, w.shape[0], used_blocks, w.dtype)
    return dxs.astype(xs.dtype), dw, None, None
  add = lambda dw, be, dwb: dw.at[be].add(dwb.astype(jnp.float32), indices_are_sorted=True,
                                          mode="promise_in_bounds")
  if step >= blocks:
    # Gathered again once dy exists (common.after): else XLA may reuse the forward's gathered
    # copy, keeping it alive from the forward (or remat's recomputed forward) to here.
    wb = _gather_blocks(*common.after((w, block_expert), dy))
    dxs, dwb = _block_grads(xs, dy, wb)
    dw = add(jnp.zeros(w.shape, jnp.float32), block_expert, dwb).astype(w.dtype)
    return dxs, dw, None, None
  xs_s, be_s = _in_steps(step, xs, block_expert)
  dy_s, _ = _in_steps(step, dy, block_expert)

  def one_step(i, carry):
    dxs, dw = carry
    dx, dwb = _block_grads(xs_s[i], dy_s[i], _gather_blocks(w, be_s[i]))
    return dxs.at[i].set(dx), add(dw, be_s[i], dwb)

  dxs, dw = jax.lax.fori_loop(0, _steps_used(step, xs_s.shape[0], used_blocks), one_step,
                              (jnp.zeros_like(xs_s), jnp.zeros(w.shape, jnp.float32)))
  return dxs.reshape(-1, *dxs.shape[2:])[:blocks], dw.astype(w.dtype), None, None


_expert_matmul.defvjp(_expert_matmul_fwd, _expert_matmul_bwd)


def blocked_dispatch(x, experts, cfg: ModelConfig, num_experts=None, first_expert=None):
  """x [tokens, embed] -> (rows [blocks, block, embed], layout): `blocked_layout` and the
  gather, over `num_experts` (default all) experts from `first_expert`."""
  n, k = experts.shape
  num_experts = num_experts or cfg.num_experts
  block = block_size(n * k, num_experts, cfg.moe_block_size)
  layout = blocked_layout(experts, num_experts, block, first_expert)
  _, row_token, row_valid, block_expert, _ = layout
  xs = jnp.where(row_valid[:, None], x.astype(cfg.jnp_dtype)[row_token], 0)
  return xs.reshape(block_expert.shape[0], block, x.shape[-1]), layout


def blocked_expert_mlp(p, xs, block_expert, cfg: ModelConfig, used_blocks=None, layer=None,
                       x_every: int = 1):
  """The SwiGLU of each block's expert: xs [blocks, block, embed] -> [blocks, block, embed]
  (blocks after `used_blocks`, when given, are not computed: zeros). With `layer`, p's experts
  are every layer's stack and `blocked_fused` reads that layer's in place (inference: no
  gradient), and xs may hold one block for every `x_every` (`moe_fused.block_swiglu`)."""
  dt = cfg.jnp_dtype
  step = blocks_per_step(cfg, xs.shape[0], p["wi_gate"].shape[-3:], jnp.dtype(dt).itemsize)
  fused = dispatch_of(cfg) == "blocked_fused"
  if layer is not None:
    if not fused:
      raise ValueError("stacked experts with a layer index are for moe_dispatch=blocked_fused")
    # Inference: gate, up and their product in one kernel (two fewer launches a layer).
    act = moe_fused.block_swiglu(xs, p["wi_gate"], p["wi_up"], block_expert, used_blocks, layer,
                                 x_every)
    return moe_fused.block_matmul(act, p["wo"], block_expert, used_blocks, layer)
  mm = lambda a, w: _expert_matmul(a, w.astype(dt), block_expert, step, fused, used_blocks)
  gate, up = mm(xs, p["wi_gate"]), mm(xs, p["wi_up"])         # [blocks, block, expert_mlp]
  act = common.constrain(jax.nn.silu(gate) * up, (None, None, "expert_mlp"))
  return mm(act, p["wo"])


def blocked_combine(ys, pos_of_pair, weights):
  """ys [blocks, block, embed] -> [tokens, embed]: each token's k rows, weighted and summed (a
  pair without a row, `pos_of_pair` out of range, adds zero)."""
  n, k = weights.shape
  h = ys.shape[-1]
  ys = ys.reshape(-1, h)
  ys_pairs = ys.at[pos_of_pair].get(unique_indices=True, mode="fill", fill_value=0)
  return jnp.einsum("nkh,nk->nh", ys_pairs.reshape(n, k, h), weights.astype(ys.dtype))


def _pair_experts(p, x, weights, experts, cfg: ModelConfig, first_expert, layer):
  """`blocked_fused` at decode (`layer` given) with fewer pairs than experts, where the blocked
  layout's blocks are single rows anyway: each (token, slot) pair is its own block in token
  order, its expert's matrix read by the kernel where it lies, with none of the layout's
  sorting, counting and scattering (about 7 of a decode step's ~20 kernels a MoE layer). A pair
  of another device's expert (`first_expert`) gets expert -1: no row read, zeros."""
  n, k = experts.shape
  flat = experts.reshape(-1).astype(jnp.int32)
  if first_expert is not None:
    flat = flat - first_expert
    flat = jnp.where((flat >= 0) & (flat < p["wi_gate"].shape[-3]), flat, -1)
  # Pair i reads token i // k's row in the kernel: no [n*k, embed] copy of the tokens.
  ys = blocked_expert_mlp(p, x.astype(cfg.jnp_dtype)[:, None, :], flat, cfg, None, layer, k)
  return jnp.einsum("nkh,nk->nh", ys.reshape(n, k, -1), weights.astype(ys.dtype))


def _blocked_experts(p, x, weights, experts, cfg: ModelConfig, first_expert=None, layer=None):
  """The blocked dispatch, SwiGLU and combine. With `first_expert`, p holds only the experts
  from there on (a device's share under expert parallelism): only their pairs get rows, the
  matmul loop stops after their blocks, and the result is this share's part of each token's
  sum. `layer`: as in `blocked_expert_mlp` (with fewer pairs than experts, `_pair_experts`)."""
  if layer is not None and block_size(experts.size, p["wi_gate"].shape[-3],
                                      cfg.moe_block_size) == 1:
    return _pair_experts(p, x, weights, experts, cfg, first_expert, layer)
  xs, (pos_of_pair, _, _, block_expert, used) = blocked_dispatch(
      x, experts, cfg, p["wi_gate"].shape[-3], first_expert)
  ys = blocked_expert_mlp(p, xs, block_expert, cfg, used if first_expert is not None else None,
                          layer)
  return blocked_combine(ys, pos_of_pair, weights)


def ragged_dispatch(x, experts, cfg: ModelConfig):
  """x [tokens, embed] -> (rows [tokens * k, embed] sorted by expert, (order, group_sizes))."""
  k = experts.shape[1]
  flat_experts = experts.reshape(-1)
  order = jnp.argsort(flat_experts, stable=True)          # (token, slot) pairs grouped by expert
  group_sizes = jnp.bincount(flat_experts, length=cfg.num_experts).astype(jnp.int32)
  return x[order // k].astype(cfg.jnp_dtype), (order, group_sizes)


def ragged_expert_mlp(p, xs, group_sizes, dt):
  """The SwiGLU of each row's expert, one `ragged_dot` group per expert: [rows, embed] -> same."""
  gate = jax.lax.ragged_dot(xs, p["wi_gate"].astype(dt), group_sizes)
  up = jax.lax.ragged_dot(xs, p["wi_up"].astype(dt), group_sizes)
  return jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["wo"].astype(dt), group_sizes)


def ragged_combine(ys, order, weights):
  """ys [tokens * k, embed] in expert order -> [tokens, embed]: weighted, added to each token."""
  n, k = weights.shape
  ys = ys * weights.reshape(-1)[order][:, None].astype(ys.dtype)
  return jnp.zeros((n, ys.shape[-1]), ys.dtype).at[order // k].add(ys)


def _ragged_dot_experts(p, x, weights, experts, cfg: ModelConfig):
  xs, (order, group_sizes) = ragged_dispatch(x, experts, cfg)
  ys = ragged_expert_mlp(p, xs, group_sizes, cfg.jnp_dtype)
  return ragged_combine(ys, order, weights)


# Row tile of the grouped matmul: the sorted rows are padded to a multiple of it.
GMM_ROW_TILE = 128


def _gmm(xs, w, group_sizes, first_group=None):
  """xs [rows, d_in] sorted by expert @ each group's expert w [experts, d_in, d_out].

  jax's grouped-matmul kernel for TPU (Pallas, `megablox`, with its own VJP: the weight
  gradient is a transposed grouped matmul); on other platforms Pallas' interpreter runs it
  (the tests' CPU). Tiles of 128 on every dimension, or the whole dimension when smaller.
  `first_group`: w holds only the experts first_group .. first_group + len(w) - 1 of
  `group_sizes`' (a device's share under expert parallelism); the kernel visits only their
  rows' tiles and the other rows come out zero.
  """
  interpret = config_lib.platform() != "tpu"
  tiling = (GMM_ROW_TILE, min(128, xs.shape[1], w.shape[2]), min(128, xs.shape[1], w.shape[2]))
  offset = None if first_group is None else jnp.asarray(first_group, jnp.int32)
  return megablox.gmm(xs, w, group_sizes, xs.dtype, tiling, offset, None, False, interpret)


def _gmm_experts(p, x, weights, experts, cfg: ModelConfig, first_expert=None):
  """The ragged layout (rows sorted by expert, no padding per expert) through `_gmm`: each
  expert's weights are read once, not copied per block; the rows are padded at the end to
  whole row tiles, counted in the last expert's group (zero rows: zero outputs, no gradient).
  With `first_expert`, p holds only the experts from there on (`_gmm`): the pairs routed to
  other experts add nothing, so the result is this share's part of each token's sum."""
  xs, (order, group_sizes) = ragged_dispatch(x, experts, cfg)
  rows = xs.shape[0]
  pad = -rows % GMM_ROW_TILE
  xs = jnp.pad(xs, ((0, pad), (0, 0)))
  group_sizes = group_sizes.at[-1].add(pad)
  dt = cfg.jnp_dtype
  gate = _gmm(xs, p["wi_gate"].astype(dt), group_sizes, first_expert)
  up = _gmm(xs, p["wi_up"].astype(dt), group_sizes, first_expert)
  ys = _gmm(jax.nn.silu(gate) * up, p["wo"].astype(dt), group_sizes, first_expert)
  return ragged_combine(ys[:rows], order, weights)


def routed_experts(p, x, weights, experts, cfg: ModelConfig, layer=None):
  """Dropless expert computation. x [tokens, embed]; weights, experts [tokens, k] -> [tokens, embed].
  `layer`: p's experts are every layer's stack, this layer's index (`blocked_fused` only)."""
  dispatch = dispatch_of(cfg)
  if dispatch in ("blocked", "blocked_fused"):
    return _blocked_experts(p, x, weights, experts, cfg, layer=layer)
  if dispatch == "gmm":
    return _gmm_experts(p, x, weights, experts, cfg)
  return _ragged_dot_experts(p, x, weights, experts, cfg)


def _group_tokens(x, groups_b: int, groups_s: int):
  """x [b, s, h] -> [groups_b * groups_s, tokens of a group, h], groups in mesh order."""
  b, s, h = x.shape
  x = x.reshape(groups_b, b // groups_b, groups_s, s // groups_s, h)
  return jnp.swapaxes(x, 1, 2).reshape(groups_b * groups_s, -1, h)


def _ungroup_tokens(y, b: int, s: int, groups_b: int, groups_s: int):
  """Inverse of `_group_tokens` for y [groups, tokens of a group, ...]."""
  rest = y.shape[2:]
  y = y.reshape(groups_b, groups_s, b // groups_b, s // groups_s, *rest)
  return jnp.swapaxes(y, 1, 2).reshape(b, s, *rest)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_shards(w, dt, dims: tuple):
  """Inside a shard_map: this device's shard of w in `dt`, all-gathered along each (dimension,
  mesh axes) of `dims`. Its gradient goes back as this device's shard, summed over those axes
  in float32 (a reduce-scatter; cast to w's dtype after). Written out rather than left to the
  shard_map's layout: there XLA gathered the float32 weights in the backward and all-reduced
  their whole float32 gradient (35B-A3B's RL step on 16 H200 with `blocked_fused`: 17k GiB of
  float32 all-gathers and 15.7k of all-reduces a GPU a step, compiler figures)."""
  w = w.astype(dt)
  for d, names in dims:
    w = jax.lax.all_gather(w, names, axis=d, tiled=True)
  return w


def _gather_shards_fwd(w, dt, dims):
  return _gather_shards(w, dt, dims), jnp.zeros((0,), w.dtype)


def _gather_shards_bwd(dt, dims, like, g):
  g = g.astype(jnp.float32)
  for d, names in reversed(dims):
    g = jax.lax.psum_scatter(g, names, scatter_dimension=d, tiled=True)
  return (g.astype(like.dtype),)


_gather_shards.defvjp(_gather_shards_fwd, _gather_shards_bwd)


# `moe_expert_parallel="auto"`: expert parallelism where the rows it gathers (ways x tokens x
# top-k, each `embed` wide, held a few times over: the sorted rows, the SwiGLU's halves, their
# gradients; ~4) take fewer bytes than gathering the layer's experts whole (3 matrices of
# experts x embed x expert_mlp, and their float32 gradients: ~9 in bfloat16 units), i.e. rows
# < EP_AUTO_ROWS_PER_EXPERT_WIDTH x experts x expert_mlp. Qwen3.5-397B-A17B's rows of 160k
# over 512 devices: 51,200 rows against 1.18 M, on; 35B-A3B's over 32 devices: 655,360
# against 295 k, off (compiler figures in docs/results.md).
EP_AUTO_ROWS_PER_EXPERT_WIDTH = 9 / 4


def expert_parallel(cfg: ModelConfig, ways: int, tokens: int) -> bool:
  """Whether `_routed_sharded` moves `tokens` (a device's) to experts split `ways` ways
  (`cfg.moe_expert_parallel`: on | off | auto, see EP_AUTO_ROWS_PER_EXPERT_WIDTH)."""
  if cfg.moe_expert_parallel != "auto":
    return cfg.moe_expert_parallel == "on"
  rows = ways * tokens * cfg.num_experts_per_tok
  return rows < EP_AUTO_ROWS_PER_EXPERT_WIDTH * cfg.num_experts * cfg.moe_intermediate_size


def _experts_spec(p) -> PartitionSpec:
  """The mesh layout of the experts' [experts, embed, expert_mlp] weights under the current
  rules (their `embed` dimension left out: gathered wherever the experts are used)."""
  rules = sharding.rules_from_config(nn.get_logical_axis_rules())
  return sharding.logical_to_spec(("experts", None, "expert_mlp"), rules,
                                  jax.sharding.get_abstract_mesh(), p["wi_gate"].shape[-3:])


def _expert_parallel_axes(p, cfg: ModelConfig, axes: tuple, tokens: int) -> tuple:
  """The mesh axes a device's `tokens` move over to the devices holding their experts, or ()
  where the experts are gathered to the tokens instead: tokens move only where the expert axes
  split the tokens too (otherwise those devices hold the same tokens) and `expert_parallel`
  says so. Where nothing splits the tokens (`axes` empty: a rollout engine's prefill of one
  prompt, or its decode slots on a mesh whose batch axes are 1) every device holds all of
  them, and the expert axes are used unless `moe_expert_parallel=off`: each device computes
  its experts' pairs and the partial sums are added, where gathering the experts would also
  have every device compute every pair."""
  mesh = jax.sharding.get_abstract_mesh()
  ep = tuple(a for a in sharding.target_axes(_experts_spec(p)[0]) if mesh.shape[a] > 1)
  if ep and not axes:
    return ep if cfg.moe_expert_parallel != "off" else ()
  if ep and set(ep) <= set(axes) and expert_parallel(
      cfg, math.prod(mesh.shape[a] for a in ep), tokens):
    return ep
  return ()


def _expert_shards(p, ep: tuple, layer=None) -> tuple[dict, dict]:
  """({name: PartitionSpec}, {name: gathers}) of the routed experts' weights entering
  `_routed_sharded`, and the (dimension, mesh axes) `_gather_shards` gathers inside. Experts
  gathered whole (`ep` empty): their own layout under the current rules, `experts` and `embed`
  gathered inside, `expert_mlp` left split. Under expert parallelism the experts stay split
  and their `embed` dimension enters whole, gathered by XLA as before: written out there too,
  the 397B-A17B step on 128 H200 moved the same bytes and held ~10 GiB more a GPU (compiler
  figures, docs/results.md). `layer`: p's experts are every layer's stack."""
  rules = sharding.rules_from_config(nn.get_logical_axis_rules())
  mesh = jax.sharding.get_abstract_mesh()
  lead = 0 if layer is None else 1
  specs, gathers = {}, {}
  for k, logical in axes_of_experts().items():
    spec = sharding.logical_to_spec(logical, rules, mesh, p[k].shape[-3:])
    if ep:
      spec = PartitionSpec(*(None if name == "embed" else spec[d]
                             for d, name in enumerate(logical)))
      dims = []
    else:
      split = [tuple(a for a in sharding.target_axes(t) if mesh.shape[a] > 1) for t in spec]
      dims = [(lead + d, split[d]) for d, name in enumerate(logical)
              if split[d] and name in ("embed", "experts")]
    specs[k] = PartitionSpec(*((None,) * lead), *spec)
    # Outer mesh axes first: a mesh's devices are laid out host-major, so its outer axes are
    # the ones between hosts, the slow links. Gathered there first, the weights cross them as
    # the smallest shard; in the backward the gradient crosses them last, already reduced over
    # the axes within a host (35B-A3B on 2 x 8 H200: 1/16 of each matrix between the hosts
    # rather than 1/2).
    gathers[k] = tuple(sorted(dims, key=lambda dn: min(mesh.axis_names.index(a) for a in dn[1])))
  return specs, gathers


def _routed_sharded(p, flat, cfg: ModelConfig, axes: tuple, groups_b: int, groups_s: int, b, s,
                    ep: tuple, layer=None):
  """Routing and routed experts of each token group on its own devices, a `shard_map` over the
  token groups' mesh axes: each device routes its own tokens against the whole router. A
  shard_map, not a `jax.vmap` with `spmd_axis_name` left to XLA to partition: XLA does not
  partition a Pallas kernel (`gmm`, `blocked_fused`), and for `blocked` its layout of the
  gathered experts varied with their sizes (float32 gathers, whole float32 gradients
  all-reduced; tests/models/layers/test_moe.py).

  Expert parallelism: where the `experts` rule splits the experts over mesh axes that also
  split the tokens, the tokens move to the experts instead of the experts to the tokens. Each
  device keeps its share of the experts (gathered only over the axes that split their other
  dimensions, like FSDP's weights) and gathers the tokens of the devices that share its
  position on the expert axes (with their routing): the grouped matmul runs only the pairs
  routed to its experts (`_gmm`'s first_group; the blocked loop stops after their blocks) and
  the partial sums go back to the tokens' devices summed (a reduce-scatter, in float32), over
  the axes `ep` (`_expert_parallel_axes`); where no mesh axis splits the tokens, each device
  runs its experts' pairs of all of them and the partial sums are added (a psum). Nothing is
  dropped: every pair is computed once, on the device holding its expert, and a device's
  matmul rows are its experts' share of the gathered pairs. The bytes moved a layer are the
  tokens' activations times the expert ways, in place of the layer's expert weights whole on
  every device (12.9 GB a layer of Qwen3.5-397B-A17B in bfloat16; 1.6 GB of 35B-A3B). With
  `ep` empty the experts are gathered whole (their `expert_mlp` split stays: the down
  projection's partial sums are added over it). `layer`: p's experts are every layer's stack
  (`blocked_fused`'s decode), laid out as one layer's, with a leading whole axis."""
  h = flat.shape[-1]
  mesh = jax.sharding.get_abstract_mesh()
  spec = _experts_spec(p)
  mlp_axes = sharding.target_axes(spec[2])
  if set(mlp_axes) & set(axes):
    raise ValueError(f"moe_dispatch={cfg.moe_dispatch!r}: the expert_mlp axes {mlp_axes} also "
                     "split the tokens")
  xg = _group_tokens(flat.reshape(b, s, h), groups_b, groups_s)
  specs, gathers = _expert_shards(p, ep, layer)
  experts_of = _gmm_experts if dispatch_of(cfg) == "gmm" else _blocked_experts

  def local(x, router, wi_gate, wi_up, w_out, at):
    experts_of_here = experts_of if layer is None else functools.partial(experts_of, layer=at)
    logits, weights, experts = route(router, x[0], cfg, None if layer is None else 0)
    w = {k: _gather_shards(v, cfg.jnp_dtype, gathers[k])
         for k, v in (("wi_gate", wi_gate), ("wi_up", wi_up), ("wo", w_out))}
    if ep:
      # Tokens split over the expert axes are gathered from the devices sharing this one's
      # place and their sums scattered back; tokens every device holds are summed in place.
      gather = ((lambda a: jax.lax.all_gather(a, ep, axis=0, tiled=True)) if axes
                else (lambda a: a))
      first = jax.lax.axis_index(ep) * wi_gate.shape[-3]
      part = experts_of_here(w, gather(x[0]), gather(weights), gather(experts), cfg, first)
      part32 = part.astype(jnp.float32)
      out = (jax.lax.psum_scatter(part32, ep, scatter_dimension=0, tiled=True) if axes
             else jax.lax.psum(part32, ep)).astype(part.dtype)
    else:
      out = experts_of_here(w, x[0], weights, experts, cfg)
    if mlp_axes:
      out = jax.lax.psum(out, mlp_axes)
    return out[None], logits[None]

  groups = PartitionSpec(axes or None)
  # Every device takes the router whole: with `layer`, the layer's matrix only (as a stack of
  # one), not every layer's stack gathered at each layer.
  router = p["router"] if layer is None else jax.lax.dynamic_slice_in_dim(p["router"], layer, 1)
  out, logits = jax.shard_map(
      local, mesh=mesh, in_specs=(groups, PartitionSpec(), specs["wi_gate"], specs["wi_up"],
                                  specs["wo"], PartitionSpec()),
      out_specs=(groups, groups), check_vma=False)(
          xg, router, p["wi_gate"], p["wi_up"], p["wo"],
          jnp.asarray(0 if layer is None else layer, jnp.int32))
  return (_ungroup_tokens(out, b, s, groups_b, groups_s).reshape(b * s, h),
          _ungroup_tokens(logits, b, s, groups_b, groups_s).reshape(b * s, -1))


@jax.custom_vjp
def _gate_logit(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [..., embed] . w [embed] -> [..., 1] in float32, the shared expert's gate: a weighted
  sum over the embedding, not a matmul with one output column (a bfloat16 product is exact in
  float32, so this is the matmul's float32 accumulation). XLA:GPU's Triton GEMM emitter fails
  on that one-column matmul when it reads a layer's slice of an unrolled stack ("Reshape input
  and output shapes must be the same, got 1x16 -> 16x8", jax 0.10.2); a reduction has no such
  tile. The gradient is written out so that the backward keeps x in its own dtype (autodiff
  kept a float32 copy of it on CPU)."""
  return jnp.sum(x.astype(jnp.float32) * w.astype(jnp.float32), axis=-1, keepdims=True)


def _gate_logit_fwd(x, w):
  return _gate_logit(x, w), (x, w)


def _gate_logit_bwd(res, g):
  """dx = g w in x's dtype; dw = the sum over tokens of g x, in float32, then w's dtype."""
  x, w = res
  dx = (g * w.astype(jnp.float32)).astype(x.dtype)
  # Summed over the leading axes as they are: flattened, a row split by position would be
  # gathered whole first (under context parallelism).
  dw = jnp.sum(g * x.astype(jnp.float32), axis=tuple(range(x.ndim - 1)))
  return dx, dw.astype(w.dtype)


_gate_logit.defvjp(_gate_logit_fwd, _gate_logit_bwd)


def forward(p, x, cfg: ModelConfig, layer=None):
  """Sparse MoE over x [batch, seq, embed]. Returns (out, router logits [b*s, experts] f32).

  layer: None, or (`blocked_fused`, inference) the index of this layer when p's routed experts
  (wi_gate, wi_up, wo) are every layer's stacked [layers, experts, ...]: the kernel reads the
  layer's in place, where a slice of the stack would be copied out first."""
  b, s, h = x.shape
  dt = cfg.jnp_dtype
  x = x.astype(dt)
  flat = x.reshape(b * s, h)
  axes, groups_b, groups_s = common.token_groups(x.shape)
  dispatch = dispatch_of(cfg)
  mesh = jax.sharding.get_abstract_mesh()
  on_mesh = dispatch in ("blocked", "blocked_fused", "gmm") and not mesh.empty and mesh.size > 1
  # `_expert_parallel_axes` of a device's tokens (a token group's).
  ep = _expert_parallel_axes(p, cfg, axes, b * s // (groups_b * groups_s)) if on_mesh else ()
  # On a mesh each device's tokens run under a shard_map: Pallas kernels run per device (XLA
  # does not partition them), and the experts' collectives are written out (`_gather_shards`).
  if on_mesh and (dispatch in ("gmm", "blocked_fused") or ep or axes):
    with jax.named_scope("routed"):
      out, logits = _routed_sharded(p, flat, cfg, axes, groups_b, groups_s, b, s, ep, layer)
  else:
    with jax.named_scope("route"):
      logits, weights, experts = route(p["router"], flat, cfg, layer)
    with jax.named_scope("routed"):
      out = routed_experts(p, flat, weights, experts, cfg, layer)
  out = out.reshape(b, s, h)
  if cfg.shared_expert_intermediate_size:
    # On x [batch, seq, embed], not the flattened tokens: a row split by position (context
    # parallelism) has no layout as [batch * seq] that XLA keeps, and on the flattened tokens it
    # summed every row's whole [tokens, mlp] over devices (35B-A3B's step on 16 H200: 8k GiB of
    # all-reduces a GPU, compiler figures).
    with jax.named_scope("shared"):
      shared = swiglu(p, x, dt, prefix="shared_")
      scale = jax.nn.sigmoid(_gate_logit(x, p["shared_expert_gate"])).astype(dt)
    out = out + scale * shared
  return out, logits
