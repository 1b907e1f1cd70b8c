"""Gated full attention of Qwen3.5: GQA, q/k RMSNorm, partial RoPE, sigmoid output gate.

Params (shapes with logical names):
  q_proj  [embed, heads, 2 * head_dim]  per head: the query, then its output gate
  k_proj  [embed, kv_heads, head_dim]
  v_proj  [embed, kv_heads, head_dim]
  o_proj  [heads, head_dim, embed]
  q_norm, k_norm  [head_dim]            zero-centred RMSNorm over each head
"""
import functools
import math

import jax
import jax.numpy as jnp

from models import config as config_lib
from models.config import ModelConfig
from models.layers import common
from models.layers import decode_fused
from models.layers import flash_attention
from models.layers import norm
from models.layers import rope


def init(key, cfg: ModelConfig) -> dict:
  h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  kq, kk, kv, ko = jax.random.split(key, 4)
  std, dt = cfg.initializer_range, cfg.jnp_param_dtype
  return {
      "q_proj": common.normal(kq, (h, nh, 2 * hd), std, dt),
      "k_proj": common.normal(kk, (h, nkv, hd), std, dt),
      "v_proj": common.normal(kv, (h, nkv, hd), std, dt),
      "o_proj": common.normal(ko, (nh, hd, h), std, dt),
      "q_norm": jnp.zeros((hd,), dt),
      "k_norm": jnp.zeros((hd,), dt),
  }


def axes(cfg: ModelConfig) -> dict:
  del cfg
  return {
      "q_proj": ("embed", "heads", "head_dim"),
      "k_proj": ("embed", "kv_heads", "head_dim"),
      "v_proj": ("embed", "kv_heads", "head_dim"),
      "o_proj": ("heads", "head_dim", "embed"),
      "q_norm": ("norm",),
      "k_norm": ("norm",),
  }


def _project(p, x, positions, cfg: ModelConfig):
  """x [batch, seq, embed] -> q [b, s, heads, hd], gate [b, s, heads, hd], k, v [b, s, kv, hd]."""
  dt = cfg.jnp_dtype
  x = x.astype(dt)
  qg = jnp.einsum("bse,ehd->bshd", x, p["q_proj"].astype(dt))
  q, gate = jnp.split(qg, 2, axis=-1)
  k = jnp.einsum("bse,ehd->bshd", x, p["k_proj"].astype(dt))
  v = jnp.einsum("bse,ehd->bshd", x, p["v_proj"].astype(dt))
  q = norm.rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
  k = norm.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
  cos, sin = rope.rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, dt)
  q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
  q = common.constrain(q, ("batch", "activation_length", "heads", "head_dim"))
  k = common.constrain(k, ("batch", "activation_length", "kv_heads", "head_dim"))
  # The values too are projected where the row's positions are, and gathered across a row split
  # by position as k is (`_attend_causal`): left unconstrained, XLA gathered the layer's input x
  # whole instead, 4x the bytes at 35B-A3B's widths.
  v = common.constrain(v, ("batch", "activation_length", "kv_heads", "head_dim"))
  return q, gate, k, v


ATTENTION_IMPLS = config_lib.ATTENTION_IMPLS


def resolve_impl(cfg: ModelConfig, backend: str | None = None) -> str:
  """The attention implementation `cfg.attention_impl` names on `backend` (default: JAX's).

  "auto" is "reference" on CPU: XLA's `dot_product_attention` gives the same values there but
  is slower (forward+backward of the layer 1.11x the time at 4 x 256 tokens, 1.47x at
  4 x 1024: it transposes the [t, s] scores, which `_attend` avoids; docs/model.md). On GPU it
  is "cudnn" (flash attention) for 16-bit activations, which cuDNN requires, else "xla"; on
  TPU, "xla". "pallas" (JAX's Pallas flash attention, `flash_attention`) is chosen by name
  only: GPU, or Pallas' interpreter on CPU (tests).
  """
  impl = cfg.attention_impl
  backend = backend or config_lib.platform()
  half = cfg.jnp_dtype in (jnp.bfloat16, jnp.float16)
  if impl == "auto":
    if backend == "cpu":
      return "reference"
    return "cudnn" if backend == "gpu" and half else "xla"
  if impl == "cudnn":
    if backend != "gpu":
      raise ValueError(f"model.attention_impl='cudnn' needs a CUDA GPU (cuDNN flash attention); "
                       f"the JAX backend is {backend!r}: use 'auto', 'xla' or 'reference'")
    if not half:
      raise ValueError(f"model.attention_impl='cudnn' needs model.dtype bfloat16 or float16 "
                       f"(cuDNN flash attention), got {cfg.dtype!r}: use 'auto' or 'xla'")
  elif impl not in ATTENTION_IMPLS:
    raise ValueError(f"model.attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
  return impl


def stands_in_for_cudnn(cfg: ModelConfig, backend: str) -> bool:
  """Whether "pallas" compiles in place of `cfg`'s attention on `backend` where cuDNN's library
  is not installed (a GPU target compiled from a CPU machine: the compile mode,
  benchmarks/activation_memory.py): where "auto" would be cuDNN's flash attention. Pallas'
  flash attention is the nearer stand-in (no scores kept, masked tiles skipped); XLA's, the
  stand-in before, wrote every block's float32 scores (22 of the ~1B GRPO step's 193 ms
  roofline estimate, docs/results.md)."""
  return cfg.attention_impl == "auto" and resolve_impl(cfg, backend) == "cudnn"


def _attend(q, k, v, mask, cfg: ModelConfig, causal: bool = False):
  """Softmax attention in float32.

  q [b, t, heads, hd]; k, v [b, s, kv_heads, hd]; mask [b or 1, t, s] bool (True = may
  attend). causal: the mask is exactly the square lower triangle (t == s, no offset), which
  cuDNN applies itself. Returns [b, t, heads, hd] in the activation dtype.
  """
  impl = resolve_impl(cfg)
  if impl != "reference":
    scale = q.shape[-1] ** -0.5
    if impl == "cudnn" and causal:
      return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                          implementation="cudnn")
    if impl == "pallas" and causal:
      return flash_attention.causal(q, k, v)
    # The masked forms (query blocks after an offset, continuations of a cache) go through
    # XLA's version under "cudnn" and "pallas" as well: their kernels' causal mask is the
    # square's only. Decode does not come here (`_attend_cached`).
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale,
                                        implementation="xla")
  b, t, nh, hd = q.shape
  nkv = k.shape[2]
  g = nh // nkv
  # Query heads grouped by the kv head they share, in the score layout [b, kv, g, t, s]:
  # only q, k, v (small) are transposed, never the [t, s] scores, which on CPU costs as much
  # as the softmax itself.
  q = jnp.transpose(q.reshape(b, t, nkv, g, hd), (0, 2, 3, 1, 4))       # [b, kv, g, t, hd]
  k = jnp.transpose(k, (0, 2, 1, 3))                                    # [b, kv, s, hd]
  v = jnp.transpose(v, (0, 2, 1, 3))
  logits = jnp.einsum("bkgtd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
  logits = logits * (hd ** -0.5)
  logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bksd->bkgtd", probs, v)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, nh, hd)


def _attend_query_chunks(q, k, v, chunk: int, cfg: ModelConfig, offset: int = 0,
                         parts: int = 1):
  """Causal attention one block of `chunk` queries at a time, each block rematerialised.

  Peak score memory is [batch, heads, chunk, seq] instead of [batch, heads, seq, seq], in the
  forward and the backward pass alike; the result is the same softmax, computed exactly.
  Query i sits at position offset + i of the keys (offset > 0: keys of a cached prefix first).

  Under context parallelism (the row's positions split over `parts` devices, where attention
  cannot go by head: `_attend_by_head`) each step of the
  loop takes chunk / parts queries from every device's part, so every device attends its own
  queries (a step's scores are a chunk's, as without the split) and the keys and values are
  gathered once for the loop. (A loop over the row's chunks in order had all devices wait on
  one device's chunk and, as XLA partitions it, gathered the queries, keys and values again at
  every step: 1.2 PiB a step for Qwen3.5-35B-A3B's 160k rows on a v5p-32, compiler figures in
  docs/results.md.)
  """
  b, t, nh, hd = q.shape
  s = k.shape[1]
  if parts < 2 or t % parts:
    parts = 1
  part = t // parts                                 # a device's positions
  if parts > 1:
    # `chunk` queries a step over all the devices (the memory of a step as without the split):
    # chunk / parts of each device's own; one that divides the part where one of at least half
    # that size does (no padding).
    chunk = min(max(1, chunk // parts), part)
    chunk = next((c for c in range(chunk, (chunk + 1) // 2 - 1, -1) if part % c == 0), chunk)
  per = -(-part // chunk)                           # loop steps: chunks of each device's part
  # [b, parts, per, chunk, ...] (each part padded to whole chunks) -> step j: chunk j of every
  # part, [per, b, parts * chunk, ...].
  q = jnp.pad(q.reshape(b, parts, part, nh, hd),
              [(0, 0), (0, 0), (0, per * chunk - part), (0, 0), (0, 0)])
  q_blocks = jnp.moveaxis(q.reshape(b, parts, per, chunk, nh, hd), 2, 0)
  q_blocks = q_blocks.reshape(per, b, parts * chunk, nh, hd)
  positions = (jnp.arange(parts)[None, :, None] * part + jnp.arange(per)[:, None, None] * chunk
               + jnp.arange(chunk)[None, None, :]).reshape(per, parts * chunk)
  if parts > 1:
    k = common.constrain(k, ("batch", None, "kv_heads", "head_dim"))
    v = common.constrain(v, ("batch", None, "kv_heads", "head_dim"))

  @jax.checkpoint
  def block(args):
    q_i, pos = args
    if parts > 1:
      q_i = common.constrain(q_i, ("batch", "activation_length", "heads", "head_dim"))
    mask = (offset + pos)[:, None] >= jnp.arange(s)[None, :]
    out = _attend(q_i, k, v, mask[None], cfg)
    if parts > 1:
      out = common.constrain(out, ("batch", "activation_length", "heads", "head_dim"))
    return out

  out = jax.lax.map(block, (q_blocks, positions))
  out = jnp.moveaxis(out.reshape(per, b, parts, chunk, nh, hd), 0, 2)
  return out.reshape(b, parts, per * chunk, nh, hd)[:, :, :part].reshape(b, t, nh, hd)


# `attention_causal_block=-1` (auto): the block with the "reference" einsums (CPU's default).
AUTO_CAUSAL_BLOCK = 128
# ... and with XLA's attention (TPU) on rows longer than a query chunk: this many blocks.
AUTO_XLA_CAUSAL_BLOCKS = 8


def causal_block(cfg: ModelConfig, backend: str | None = None, t: int | None = None) -> int:
  """Queries per causal block for `cfg.attention_causal_block` on `backend` (0 = one block).

  Auto (-1) is `AUTO_CAUSAL_BLOCK` where the attention runs as the reference einsums (CPU's
  default): on CPU at 4 x 1024 tokens (hidden 256) the whole model step took 0.92x the time
  with blocks of 256 and 0.90x with 128 (docs/model.md). Under XLA's attention ("xla": TPU)
  with query chunks and rows of `t` longer than a chunk, whole chunks in
  `AUTO_XLA_CAUSAL_BLOCKS` blocks: XLA scores every query against every key of its masked
  square, so a 160k row in chunks did twice the causal work (0.56x of the square with 8 blocks;
  8 unrolled loops in the program rather than 1,280 blocks of 128). Else 0: cuDNN's flash
  attention skips the masked tiles itself, and short rows on XLA are not measured.
  """
  if cfg.attention_causal_block != -1:
    return cfg.attention_causal_block
  impl = resolve_impl(cfg, backend)
  if impl == "reference":
    return AUTO_CAUSAL_BLOCK
  chunk = cfg.attention_query_chunk
  if impl == "xla" and chunk and t and t > chunk:
    return chunk * -(-t // (chunk * AUTO_XLA_CAUSAL_BLOCKS))
  return 0


def _attend_causal(q, k, v, cfg: ModelConfig, offset: int = 0, recompute: bool = True):
  """Causal attention of q [b, t, heads, hd] (at key positions offset + [0, t)) over k, v:
  by head where the rows are split by position and the heads split as evenly
  (`_attend_by_head`), else on the rows as they are laid out (`_attend_rows`)."""
  ways = common.split_ways("activation_heads")
  if common.split_ways("activation_length") > 1 and q.shape[2] % ways == 0:
    return _attend_by_head(q, k, v, cfg, offset, recompute, ways)
  return _attend_rows(q, k, v, cfg, offset, recompute, parts=common.token_groups(q.shape)[2])


def _attend_by_head(q, k, v, cfg: ModelConfig, offset: int, recompute: bool, ways: int):
  """Attention of rows split by position (context parallelism) done by head, as
  DeepSpeed-Ulysses does: q, k and v move to whole rows of heads / `ways` heads a device
  (all-to-alls), each device attends its heads over the whole row, and the output moves back.

  Causal attention then skips the masked scores as on one device (cuDNN's flash attention;
  XLA's in causal blocks), where a device's share of the positions scored every key of the row:
  twice the causal work, most of 35B-A3B's RL step at 160k tokens (docs/model.md). The key and
  value heads are repeated first where the devices do not split them evenly (35B-A3B: 2 over
  16), so that every device holds those of its query heads.
  """
  nkv = k.shape[2]
  repeat = ways // math.gcd(nkv, ways)
  if repeat > 1:   # where the positions are (repeated after the move, they were gathered whole)
    k, v = (common.constrain(jnp.repeat(x, repeat, axis=2),
                             ("batch", "activation_length", "heads", "head_dim")) for x in (k, v))
  heads = ("batch", None, "activation_heads", "head_dim")
  q, k, v = (common.constrain(x, heads) for x in (q, k, v))
  out = common.constrain(_attend_rows(q, k, v, cfg, offset, recompute, parts=1), heads)
  return common.constrain(out, ("batch", "activation_length", "heads", "head_dim"))


def _attend_rows(q, k, v, cfg: ModelConfig, offset: int, recompute: bool, parts: int):
  """Causal attention of q [b, t, heads, hd] (at key positions offset + [0, t)) over k, v,
  each row's positions split over `parts` devices (1: whole rows).

  cuDNN's and Pallas' flash attention take the causal square whole (offset 0, whole rows):
  their memory is O(t) already. Otherwise `causal_block` (0 or >= t: one block; whole rows
  only) splits the queries into blocks, each scored only against the keys up to its last
  query: the scores
  above the diagonal blocks, masked away anyway, are never computed, so with n blocks the
  score work is (n + 1) / 2n of the square. The blocks differ in shape, so they are unrolled
  (n einsum pairs in the program). Within a block longer than `attention_query_chunk` (> 0),
  the queries go one chunk at a time (`_attend_query_chunks`: memory O(chunk x seq)). Exact
  either way: each softmax runs over every key its queries may see.

  recompute: the blocks' scores are recomputed in the backward pass, one block after another
  (`_recomputed_blocks`, as flash attention does), rather than kept: the gradient keeps q, k
  and v, and the scores of one block exist at a time. Without it every block's float32
  logits, softmax and 16-bit probabilities stay until the backward pass (~110 KiB a token a
  layer at 8 heads, 2048 tokens in blocks of 128). cuDNN's flash attention keeps only its own
  statistics already, and query chunks are rematerialised by `_attend_query_chunks` itself:
  both are left as they are.
  """
  t = q.shape[1]
  impl = resolve_impl(cfg)
  flash = impl in ("cudnn", "pallas")
  if flash and offset == 0 and parts == 1:
    return _attend(q, k, v, None, cfg, causal=True)
  chunk = cfg.attention_query_chunk
  block = causal_block(cfg, t=t if parts == 1 else None)
  block = block if 0 < block < t else t
  spans = tuple((start, min(start + block, t)) for start in range(0, t, block))
  chunked = chunk and any(stop - start > chunk for start, stop in spans)
  if recompute and not chunked and not flash:
    return _recomputed_blocks(q, k, v, cfg, offset, spans)
  outs = []
  for start, stop in spans:
    seen = offset + stop
    if chunk and stop - start > chunk:
      outs.append(_attend_query_chunks(q[:, start:stop], k[:, :seen], v[:, :seen], chunk, cfg,
                                       offset + start, parts))
    else:
      outs.append(_attend_block(q[:, start:stop], k, v, cfg, offset + start, seen,
                                causal=offset + start == 0))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _recomputed_blocks(q, k, v, cfg: ModelConfig, offset: int, spans: tuple):
  """The causal blocks `spans` ((start, stop) query ranges) of q over k, v, concatenated.

  The gradient keeps q, k, v; the backward pass recomputes each block's scores, the last block
  first, and each block's recomputation waits for the previous one's gradients
  (`common.after`); in the forward pass each block waits for the previous block's output. Recomputed each in its own custom VJP, the blocks would all receive their
  cotangents at once (from the concatenation) and XLA:CPU would recompute every block's scores
  before the first block's backward: all of them live together again.
  """
  return _recomputed_blocks_fwd(q, k, v, cfg, offset, spans)[0]


def _block_fns(cfg, offset, spans):
  return [functools.partial(_attend_block, cfg=cfg, start=offset + start, seen=offset + stop,
                            causal=False) for start, stop in spans]


def _recomputed_blocks_fwd(q, k, v, cfg, offset, spans):
  outs = []
  for f, (start, stop) in zip(_block_fns(cfg, offset, spans), spans):
    # One block after another here too: XLA:CPU would otherwise run every block's score
    # matmul before the first softmax.
    q_i = q[:, start:stop] if not outs else common.after(q[:, start:stop], outs[-1])
    outs.append(f(q_i, k, v))
  return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)), (q, k, v)


def _recomputed_blocks_bwd(cfg, offset, spans, residuals, g):
  q, k, v = residuals
  fns = _block_fns(cfg, offset, spans)
  dqs, dk, dv, dep = [None] * len(spans), None, None, g
  for i in reversed(range(len(spans))):
    start, stop = spans[i]
    _, vjp = jax.vjp(fns[i], *common.after((q[:, start:stop], k, v), dep))
    dqs[i], dk_i, dv_i = vjp(g[:, start:stop])
    dk, dv = (dk_i, dv_i) if dk is None else (dk + dk_i, dv + dv_i)
    dep = (dqs[i], dk, dv)
  return (dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs, axis=1)), dk, dv


_recomputed_blocks.defvjp(_recomputed_blocks_fwd, _recomputed_blocks_bwd)


def _attend_block(q, k, v, cfg: ModelConfig, start: int, seen: int, causal: bool):
  """q [b, t, heads, hd] at key positions start + [0, t) over the first `seen` keys of k, v."""
  mask = (start + jnp.arange(q.shape[1]))[:, None] >= jnp.arange(seen)[None, :]
  return _attend(q, k[:, :seen], v[:, :seen], mask[None], cfg, causal=causal)


def _output(p, out, gate, cfg: ModelConfig):
  out = out * jax.nn.sigmoid(gate)
  return jnp.einsum("bshd,hde->bse", out, p["o_proj"].astype(cfg.jnp_dtype))


def forward(p, x, positions, cfg: ModelConfig, cache=None):
  """Causal attention over a whole sequence.

  Args:
    x: [batch, seq, embed].
    positions: [batch, seq] int32.
    cache: optional {"k", "v": [batch, max_len, kv_heads, head_dim]}; when given, this
      sequence's keys and values are written at positions [0, seq) (prefill).
  Returns:
    ([batch, seq, embed], cache or None).
  """
  q, gate, k, v = _project(p, x, positions, cfg)
  out = _attend_causal(q, k, v, cfg)
  if cache is not None:
    cache = {
        "k": jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), 0, axis=1),
        "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), 0, axis=1),
    }
  return _output(p, out, gate, cfg), cache


def extend(p, x, positions, cache, cfg: ModelConfig):
  """Causal attention of a continuation over a cached prefix and itself.

  Args:
    x: [batch, seq, embed], the tokens after the prefix.
    positions: [batch, seq] int32, prefix_len + [0, seq).
    cache: {"k", "v": [batch, prefix_len, kv_heads, head_dim]}, exactly the prefix (no padding).
  Returns:
    ([batch, seq, embed], cache {"k", "v": [batch, prefix_len + seq, kv_heads, head_dim]}).
  """
  q, gate, k, v = _project(p, x, positions, cfg)
  offset = cache["k"].shape[1]
  k_all = jnp.concatenate([cache["k"].astype(k.dtype), k], axis=1)
  v_all = jnp.concatenate([cache["v"].astype(v.dtype), v], axis=1)
  out = _attend_causal(q, k_all, v_all, cfg, offset)
  cache = {"k": k_all.astype(cache["k"].dtype), "v": v_all.astype(cache["v"].dtype)}
  return _output(p, out, gate, cfg), cache


def append(p, x, positions, cache, cfg: ModelConfig):
  """Causal attention of a continuation written into a decode-layout cache after its tokens.

  The cache of a finished conversation turn (one decode slot) continued by the next turn's new
  tokens, without copying the cache into a prefix-length buffer first (`extend`'s layout).

  Args:
    x: [batch, seq, embed], the new tokens.
    positions: [batch, seq] int32, pos + [0, seq) where pos is each row's cached token count.
    cache: {"k", "v": [batch, max_len, kv_heads, head_dim]} valid on [0, pos); the caller
      guarantees pos + seq <= max_len (a dynamic slice past the end would be shifted back).
  Returns:
    ([batch, seq, embed], cache of the same shape with the new keys and values at [pos, pos + seq)).
  """
  q, gate, k, v = _project(p, x, positions, cfg)
  write = jax.vmap(lambda c, new, at: jax.lax.dynamic_update_slice_in_dim(c, new, at, axis=0))
  k_all = write(cache["k"], k.astype(cache["k"].dtype), positions[:, 0])
  v_all = write(cache["v"], v.astype(cache["v"].dtype), positions[:, 0])
  out = _attend_by_position(q, k_all.astype(q.dtype), v_all.astype(q.dtype), positions, cfg)
  return _output(p, out, gate, cfg), {"k": k_all, "v": v_all}


def _attend_by_position(q, k, v, positions, cfg: ModelConfig):
  """q [b, t, heads, hd] at `positions` [b, t] over k, v [b, s, kv, hd] indexed by position: key j
  is seen by a query at position i iff j <= i. With `attention_query_chunk` (> 0, < t) one
  rematerialised block of queries at a time, so scores stay O(chunk x s)."""
  b, t = positions.shape
  s = k.shape[1]
  chunk = cfg.attention_query_chunk
  if not chunk or t <= chunk:
    return _attend(q, k, v, positions[:, :, None] >= jnp.arange(s)[None, None, :], cfg)
  n = -(-t // chunk)
  pad = n * chunk - t
  q = jnp.pad(q, [(0, 0), (0, pad), (0, 0), (0, 0)])
  positions = jnp.pad(positions, [(0, 0), (0, pad)], mode="edge")
  q_blocks = jnp.moveaxis(q.reshape(b, n, chunk, *q.shape[2:]), 1, 0)
  pos_blocks = jnp.moveaxis(positions.reshape(b, n, chunk), 1, 0)

  @jax.checkpoint
  def block(args):
    q_i, pos_i = args
    return _attend(q_i, k, v, pos_i[:, :, None] >= jnp.arange(s)[None, None, :], cfg)

  out = jax.lax.map(block, (q_blocks, pos_blocks))
  return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, *out.shape[3:])[:, :t]


# Decode reads the cache in blocks of this many positions, and only the blocks that hold
# cached tokens of some row: a step's cost follows the longest row's length, not the cache's
# capacity (`max_len`: 2,560 in `make run`, 163,840 in the full-size configs). Each block is
# a step of a loop, which on a GPU costs a few kernel launches and a read of the trip
# condition by the host, so blocks are large there (a 160k context is 80 steps; a cache of
# at most one block has no loop). On the CPU a step costs little, and smaller blocks read
# less past the tokens: 256 measured fastest of 256, 512 and 2048 there (docs/results.md,
# "Decode against the cache's capacity").
DECODE_KV_BLOCK = {"cpu": 256}


def decode_block(backend: str | None = None) -> int:
  """Positions a decode step reads from the cache at a time on `backend` (default: JAX's)."""
  return DECODE_KV_BLOCK.get(backend or config_lib.platform(), 2048)


def decode(p, x, pos, cache, cfg: ModelConfig, layer=None):
  """One new token per row against the KV cache.

  The token's keys and values are written at `pos`, then it attends to the cache's positions
  [0, pos) and to itself, reading only the blocks of the cache that hold some row's tokens.

  Args:
    x: [batch, 1, embed].
    pos: [batch] int32, the position of the new token (= tokens already cached).
    cache: {"k", "v": [batch, max_len, kv_heads, head_dim]}, valid on [0, pos); or, with
      `layer` (an index), the stacked caches of every layer of this kind [layers, batch,
      max_len, ...], of which this layer's is read and written in place (the layer scan
      carries them: as the scan's inputs and outputs each step would copy every layer's whole
      cache).
  Returns:
    ([batch, 1, embed], the cache with the token written).
  """
  q, gate, k, v = _project(p, x, pos[:, None], cfg)
  new = {"k": k[:, 0].astype(cache["k"].dtype), "v": v[:, 0].astype(cache["v"].dtype)}
  cache = write_decoded(cache, new, pos, layer)
  if cfg.decode_attention == "fused":
    out = decode_fused.attend(q[:, 0], cache, new, pos, layer)
  else:
    out, cache = _attend_cached(q[:, 0], cache, new, pos, layer)
  return _output(p, out[:, None].astype(q.dtype), gate, cfg), cache


def write_decoded(cache, new, pos, layer=None):
  """The cache with each row's new keys and values at its `pos`.

  cache: {"k", "v": [batch, max_len, kv_heads, head_dim]}, or with a leading axis of stacked
  layers when `layer` (an index into it) is given; new: {"k", "v": [batch, kv_heads,
  head_dim]}; pos: [batch]. A row at pos == max_len writes nothing (a full slot), as an
  out-of-bounds scatter drops.
  """
  rows = jnp.arange(pos.shape[0])
  at = (rows, pos) if layer is None else (layer, rows, pos)
  return {name: cache[name].at[at].set(new[name].astype(cache[name].dtype)) for name in ("k", "v")}


def _attend_cached(q, cache, new, pos, layer=None, block: int | None = None):
  """Softmax attention of one query per row over its cached keys [0, pos) and its own key.

  q [b, heads, hd]; cache {"k", "v": [b, max_len, kv, hd]} (or stacked, [layers, ...], with
  `layer`); new {"k", "v": [b, kv, hd]}, the token's own; pos [b]. Online softmax in float32
  over blocks of `block` (default `decode_block()`) cached positions, as many as the longest
  row needs: a loop with that trip count, which carries the cache through unchanged so that
  XLA reads its blocks in place (a cache the loop only captured would be copied into the loop
  first); no loop when the cache is one block. Scores and sums are float32; each block's
  probabilities meet the values in the values' dtype, as `_attend`'s do.
  Returns ([b, heads, hd] float32, the cache).
  """
  b, nh, hd = q.shape
  lead = cache["k"].ndim - 4
  max_len, nkv = cache["k"].shape[lead + 1], cache["k"].shape[lead + 2]
  g = nh // nkv
  q = q.reshape(b, nkv, g, hd)
  q32 = q.astype(jnp.float32)
  scale = hd ** -0.5
  # Start from the token itself: its score is finite, so every running max is too.
  m = jnp.sum(q32 * new["k"].astype(jnp.float32)[:, :, None], axis=-1) * scale
  total = jnp.ones_like(m)
  acc = jnp.broadcast_to(new["v"].astype(jnp.float32)[:, :, None], (b, nkv, g, hd))
  block = min(block or decode_block(), max_len)

  def read(x, start):
    if layer is None:
      return jax.lax.dynamic_slice_in_dim(x, start, block, axis=1)
    return jax.lax.dynamic_slice(x, (layer, 0, start, 0, 0), (1, b, block) + x.shape[3:])[0]

  def add_block(i, carry):
    m, total, acc, cache = carry
    # The last block is shifted back to end at max_len; positions an earlier block covered
    # are masked out of it.
    start = jnp.minimum(i * block, max_len - block)
    k, v = read(cache["k"], start), read(cache["v"], start)                     # [b, s, kv, hd]
    at = start + jnp.arange(block)
    seen = (at[None, :] < pos[:, None]) & (at[None, :] >= i * block)           # [b, s]
    # Products and sums, not dots: a dot batched over (b, kv) wants those axes major in its
    # operands, and XLA:GPU then laid the whole carried cache out so, a transposed copy of it
    # each step (19.6 GiB a GPU for 35B-A3B's 48 slots of 160k). One token's attention is a
    # read of the block; the products fuse into that read.
    s = jnp.sum(q32[:, None] * k.astype(jnp.float32)[:, :, :, None], axis=-1) * scale
    s = jnp.where(seen[:, :, None, None], s, -jnp.inf)                         # [b, s, kv, g]
    m_new = jnp.maximum(m, s.max(axis=1))
    probs = jnp.exp(s - m_new[:, None])
    rescale = jnp.exp(m - m_new)
    total = total * rescale + probs.sum(axis=1)
    # The values' sum as one dot batched over rows only, every query head against every kv
    # head's values (kv times the FLOPs, the diagonal kept): [b, s, kv * hd] is the cache's
    # own layout, so XLA reads the block where it lies. As a product summed over s, XLA:GPU
    # again laid the whole cache out anew.
    every = jnp.einsum("bsx,bsy->bxy", probs.reshape(b, -1, nkv * g).astype(v.dtype),
                       v.reshape(b, -1, nkv * hd), preferred_element_type=jnp.float32)
    own = jnp.diagonal(every.reshape(b, nkv, g, nkv, hd), axis1=1, axis2=3)   # [b, g, hd, kv]
    acc = acc * rescale[..., None] + jnp.moveaxis(own, -1, 1)
    return m_new, total, acc, cache

  carry = (m, total, acc, cache)
  if block == max_len:
    carry = add_block(0, carry)
  else:
    carry = jax.lax.fori_loop(0, (jnp.max(pos) + block - 1) // block, add_block, carry)
  _, total, acc, cache = carry
  return (acc / total[..., None]).reshape(b, nh, hd), cache
