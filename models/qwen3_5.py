"""Qwen3.5 text model (MoE or dense), as pure functions of a parameter pytree.

    from models import qwen3_5
    cfg, params = qwen3_5.load_hf(path, dtype=jnp.float32)
    logits = qwen3_5.forward(cfg, params, tokens)          # [batch, seq, vocab] float32

Parameters are a plain dict. Layers are grouped by their position in the repeating cycle of
`layer_types` (3 Gated DeltaNet + 1 attention): `params["blocks"][j]` holds the weights of
every layer at cycle position j, stacked on a leading [num_cycles] axis, and the forward pass
is one `lax.scan` over cycles, so compile time does not grow with depth.

    params = {
      "embed":      [vocab, embed],
      "blocks":     tuple over cycle positions of {
                      "input_norm": [cycles, embed], "post_norm": [cycles, embed],
                      "mixer": gated_deltanet or attention params, "ffn": moe or mlp params},
      "final_norm": [embed],
      "lm_head":    [embed, vocab]            (absent when tied to the embedding)
    }

`param_axes(cfg)` returns the same tree with a tuple of logical axis names per leaf.
"""
import functools
import math

import jax
import jax.numpy as jnp

from models import config as config_lib
from models import hf_io
from models import lora
from models.config import FULL, LINEAR, ModelConfig
from models.layers import attention
from models.layers import common
from models.layers import gated_deltanet
from models.layers import moe
from models.layers import norm

__all__ = [
    "ModelConfig", "init_params", "param_axes", "forward", "forward_hidden", "logits_from_hidden",
    "token_logprobs",
    "init_cache", "prefill", "prefill_extend", "decode_step", "cache_insert", "count_params", "load_hf", "save_hf",
]


# -- parameters ---------------------------------------------------------------------------

def _init_layer(key, cfg: ModelConfig, layer_type: str) -> dict:
  k_mix, k_ffn = jax.random.split(key)
  mixer = (gated_deltanet.init if layer_type == LINEAR else attention.init)(k_mix, cfg)
  if cfg.use_moe:
    ffn = moe.init(k_ffn, cfg)
  else:
    ffn = moe.init_mlp(k_ffn, cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range,
                       cfg.jnp_param_dtype)
  zeros = jnp.zeros((cfg.hidden_size,), cfg.jnp_param_dtype)
  return {"input_norm": zeros, "post_norm": zeros, "mixer": mixer, "ffn": ffn}


def _layer_axes(cfg: ModelConfig, layer_type: str) -> dict:
  mixer = (gated_deltanet.axes if layer_type == LINEAR else attention.axes)(cfg)
  ffn = moe.axes(cfg) if cfg.use_moe else moe.mlp_axes()
  return {"input_norm": ("norm",), "post_norm": ("norm",), "mixer": mixer, "ffn": ffn}


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
  """Random parameters (HF-style init: normal(initializer_range), norms at their identity)."""
  k_embed, k_head, k_layers = jax.random.split(key, 3)
  blocks = []
  for j, layer_type in enumerate(cfg.cycle):
    keys = jax.random.split(jax.random.fold_in(k_layers, j), cfg.num_cycles)
    blocks.append(jax.vmap(lambda k, t=layer_type: _init_layer(k, cfg, t))(keys))
  dt = cfg.jnp_param_dtype
  params = {
      "embed": common.normal(k_embed, (cfg.vocab_size, cfg.hidden_size), cfg.initializer_range, dt),
      "blocks": tuple(blocks),
      "final_norm": jnp.zeros((cfg.hidden_size,), dt),
  }
  if not cfg.tie_word_embeddings:
    params["lm_head"] = common.normal(k_head, (cfg.hidden_size, cfg.vocab_size),
                                      cfg.initializer_range, dt)
  return params


def param_axes(cfg: ModelConfig) -> dict:
  """Logical axis names for every parameter, in the structure of `init_params`."""
  blocks = tuple(
      jax.tree.map(lambda a: ("layers",) + a, _layer_axes(cfg, t), is_leaf=lambda a: isinstance(a, tuple))
      for t in cfg.cycle)
  axes = {"embed": ("vocab", "embed"), "blocks": blocks, "final_norm": ("norm",)}
  if not cfg.tie_word_embeddings:
    axes["lm_head"] = ("embed", "vocab")
  return axes


def unscan_layers(cfg: ModelConfig, tree: dict) -> dict:
  """`tree` (params or LoRA adapters in `cfg`'s layout: `blocks` stacked by cycle position)
  in the layout of `cfg.replace(scan_layers=False)`: `blocks` one entry a layer, in order, each
  leaf [1, ...] (layer i is cycle i // len(cycle) at cycle position i % len(cycle)).

  For serving (`rollout.scan_layers=False`, rl/rollout/engine_weights.py): scanned, a decode
  step slices each cycle's weights out of the stacks, and XLA:GPU copies most of those slices
  before the matmuls that read them (the ~1B benchmark model at 8 sequences on an H200: 72 of
  the step's 522 kernels; 35B-A3B's engine on 8 H200s: ~1.2 GiB a GPU a step written and read
  again; compiler figures, docs/results.md). Unscanned, every weight is its own buffer, read
  in place; compile time grows with depth. On arrays this slices (a copy of each leaf).
  """
  return dict(tree, blocks=tuple(unscanned_layer(cfg, tree, i)
                                 for i in range(cfg.num_hidden_layers)))


def fuse_gdn_in_projections(tree: dict, shards: int) -> dict:
  """`tree` (params in any layout of `blocks`) with each Gated DeltaNet layer's four input
  projections as one matrix laid out for `shards` devices (`gated_deltanet.fuse_in_projections`):
  the rollout engine's layout (rl/rollout/engine_weights.py)."""
  return _map_gdn_mixers(tree, "in_proj_qkv",
                         functools.partial(gated_deltanet.fuse_in_projections, shards=shards))


def fused_gdn_in_projection_axes(axes: dict) -> dict:
  """`param_axes` (any layout of `blocks`) for `fuse_gdn_in_projections`' layout."""
  return _map_gdn_mixers(axes, "in_proj_qkv", gated_deltanet.fused_in_projection_axes)


def split_gdn_in_projections(cfg: ModelConfig, tree: dict) -> dict:
  """`fuse_gdn_in_projections` undone (params)."""
  return _map_gdn_mixers(tree, "in_proj",
                         functools.partial(gated_deltanet.split_in_projections, cfg=cfg))


def _map_gdn_mixers(tree: dict, key: str, fn) -> dict:
  """`tree` with `fn` applied to the mixer of each block whose mixer holds `key`."""
  def block(b):
    return dict(b, mixer=fn(b["mixer"])) if key in b.get("mixer", {}) else b
  return dict(tree, blocks=tuple(block(b) for b in tree["blocks"]))


def unscanned_layer(cfg: ModelConfig, tree: dict, i: int) -> dict:
  """Layer i of `tree` (in `cfg`'s layout) as `unscan_layers` holds it: its leaves [1, ...]."""
  c, j = divmod(i, len(cfg.cycle))
  return jax.tree.map(lambda a: a[c:c + 1], tree["blocks"][j])


# -- forward ------------------------------------------------------------------------------

def _block(p, x, positions, cfg: ModelConfig, layer_type: str, cache, lengths, mode: str,
           layer=None, experts_layer=None):
  """One pre-norm residual block: mixer then feed-forward. Returns (x, router logits, cache).

  mode: "prefill" (a whole sequence from position 0), "extend" (a continuation of the cached
  prefix in `cache`), "append" (a continuation written into a decode-layout cache) or "decode"
  (one token per row against the cache; an attention layer's cache, and with
  `gdn_decode=fused` a Gated DeltaNet layer's, is then every cycle's stacked one, `layer` the
  index of this block's cycle in it). `experts_layer`: p's routed
  experts are every cycle's stack and this block's cycle is that index (`moe.forward`).
  """
  # The named scopes label each part's ops in a profile (op names "gdn/...", "moe/...").
  h = norm.rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
  with jax.named_scope("gdn" if layer_type == LINEAR else "attention"):
    if layer_type == LINEAR:
      h, cache = gated_deltanet.forward(p["mixer"], h, cfg, state=cache, lengths=lengths,
                                        rule="recurrent" if mode == "decode" else "chunked",
                                        layer=layer)
    elif mode == "decode":
      h, cache = attention.decode(p["mixer"], h, positions[:, 0], cache, cfg, layer=layer)
    elif mode == "extend":
      h, cache = attention.extend(p["mixer"], h, positions, cache, cfg)
    elif mode == "append":
      h, cache = attention.append(p["mixer"], h, positions, cache, cfg)
    else:
      h, cache = attention.forward(p["mixer"], h, positions, cfg, cache=cache)
  x = x + h.astype(x.dtype)
  h = norm.rms_norm(x, p["post_norm"], cfg.rms_norm_eps)
  with jax.named_scope("moe" if cfg.use_moe else "mlp"):
    if cfg.use_moe:
      h, router_logits = moe.forward(p["ffn"], h, cfg, layer=experts_layer)
    else:
      h, router_logits = moe.swiglu(p["ffn"], h, cfg.jnp_dtype), None
  x = x + h.astype(x.dtype)
  x = common.constrain(x, ("batch", "activation_length", "activation_embed"))
  return x, router_logits, cache


# `scan_unroll=-1` (auto) without remat unrolls models of at most this many layer cycles, per
# backend (default 2; docs/model.md, "Layers are scanned").
AUTO_UNROLL_CYCLES = {"gpu": 4, "cuda": 4, "rocm": 4}


def scan_unroll(cfg: ModelConfig, backend: str | None = None) -> int:
  """Layer cycles per step of the layer scan for `cfg.scan_unroll` (0 = all, -1 = auto).

  The scan's backward copies every stacked residual into its slot of the stacked buffers (on
  CPU ~15% of the step at 4 x 1024 tokens, 2 cycles); unrolled, those copies go, but compile
  time then grows with depth. Auto unrolls up to `AUTO_UNROLL_CYCLES` cycles of `backend`
  (default the platform traced for): 2 where the unrolled program compiles no slower than the
  scanned one (measured on CPU, docs/model.md), and scans one cycle a step beyond, keeping
  compile time flat in depth. On a GPU up to 4: there the copies and the scan's per-layer
  launches are a larger share of a step (the ~1B benchmark model's 3 cycles ran faster
  unrolled on an H200). Under remat auto scans one cycle a step at any depth: the loop is what
  keeps the recomputation in the backward pass; unrolled, XLA runs it beside the forward and
  the step holds about what it would without remat (`_run_layers`; figures in docs/model.md).
  """
  if cfg.scan_unroll == -1:
    if cfg.remat != "none":
      return 1
    limit = AUTO_UNROLL_CYCLES.get(backend or config_lib.platform(), 2)
    return cfg.num_cycles if cfg.num_cycles <= limit else 1
  return cfg.scan_unroll or cfg.num_cycles


def _run_layers(cfg: ModelConfig, params, x, positions, cache=None, lengths=None,
                mode: str = "prefill"):
  """Scans the layer cycle over x [batch, seq, embed]. Returns (x, router logits, cache).

  The cache's layers are scanned inputs and the new cache the scan's outputs, except when
  decoding: every layer's cache then rides in the scan's carry, stacked. An attention layer
  writes its token and reads its blocks in place; a Gated DeltaNet layer reads its cycle's
  state and writes the new one back in place. As scanned inputs and outputs they would be
  copied whole every step (tests/models/test_qwen3_5.py).
  """
  adapters = params.get("lora")   # lora.attach: merged here one layer at a time
  carried = [mode == "decode"] * len(cfg.cycle)
  # An unscanned prefill makes each layer's output and cache before the next layer starts, as
  # a scan's step boundary would. Otherwise XLA may defer a layer's cache branch (a Gated
  # DeltaNet layer's final state) and keep its inputs alive across layers: compiled for 8
  # H200s, 35B-A3B's 4,096-token prefill held 4.1 GB of temporaries a GPU, 3.1 with the
  # barrier, 1.4 scanned. Not in decode, where temporaries are small and the barrier would keep
  # XLA from fusing across layers (+69 kernels a step in that engine).
  barrier = not cfg.scan_layers and cache is not None and mode != "decode"
  blocks_params, experts = _split_stacked_experts(cfg, params["blocks"], mode, adapters)

  def cycle_body(carry, xs):
    x, kv = carry
    block_params, block_cache, block_adapters, cycle = xs
    router, new_cache = [], []
    kv = list(kv)
    for j, layer_type in enumerate(cfg.cycle):
      c = None if block_cache is None else block_cache[j]
      # attention.decode (and with gdn_decode=fused the Gated DeltaNet) indexes the stack.
      in_place = carried[j] and (layer_type == FULL or cfg.gdn_decode == "fused")
      if in_place:
        c = kv[j]
      elif carried[j]:
        c = jax.tree.map(lambda a: a[cycle], kv[j])
      p = block_params[j]
      if experts[j] is not None:
        p = dict(p, ffn=dict(p["ffn"], **experts[j]))
      if block_adapters is not None:
        p = lora.merge_block(p, block_adapters[j], adapters["scale"])
      x, r, c = _block(p, x, positions, cfg, layer_type, c, lengths, mode,
                       layer=cycle if in_place else None,
                       experts_layer=cycle if experts[j] is not None else None)
      if barrier:
        x, c = jax.lax.optimization_barrier((x, c))
      if in_place:
        kv[j], c = c, None
      elif carried[j]:
        kv[j] = jax.tree.map(lambda a, n: a.at[cycle].set(n.astype(a.dtype)), kv[j], c)
        c = None
      router.append(r)
      new_cache.append(c)
    return (x, tuple(kv)), (tuple(router), None if block_cache is None else tuple(new_cache))

  unroll = scan_unroll(cfg)
  if cfg.remat == "full":
    # Fully unrolled (scan_unroll=0), no loop stands between the forward and the backward's
    # recomputation, and without `prevent_cse` XLA merges the two: nothing is rematerialised.
    # With it XLA still runs part of the recomputation early, so auto scans under remat
    # (figures: docs/model.md, "Layers are scanned over the repeating cycle").
    cycle_body = jax.checkpoint(cycle_body, prevent_cse=unroll >= cfg.num_cycles)
  blocks_cache = None if cache is None else cache["blocks"]
  kv = ()
  if any(carried):
    kv = tuple(b if c else None for b, c in zip(blocks_cache, carried))
    blocks_cache = tuple(None if c else b for b, c in zip(blocks_cache, carried))
  blocks_adapters = None if adapters is None else adapters["blocks"]
  (x, kv), (router, new_blocks) = jax.lax.scan(
      cycle_body, (x, kv), (blocks_params, blocks_cache, blocks_adapters,
                            jnp.arange(cfg.num_cycles)), unroll=unroll)
  if any(carried):
    new_blocks = tuple(k if c else b for k, b, c in zip(kv, new_blocks, carried))
  return x, router, new_blocks


# What a decode step's MoE kernels read from every layer's stack by the layer's index
# (`blocked_fused`): the routed experts and the router.
_ROUTED = ("router", "wi_gate", "wi_up", "wo")


def _split_stacked_experts(cfg: ModelConfig, blocks, mode: str, adapters):
  """(the blocks the layer scan slices, each cycle position's routed experts left whole or None).

  With `moe_dispatch=blocked_fused` a decode step (no adapters merged in the scan: the engine
  serves merged weights) leaves the routed experts out of the scan's inputs: the kernel reads
  each cycle's from the whole stack by its index, where the scan's slice of them would be
  copied out for the kernel (the layer's every expert, each step); so does the router's matrix,
  which the routing kernel reads (`moe_fused.route`)."""
  none = (None,) * len(blocks)
  if (mode != "decode" or adapters is not None or not cfg.use_moe
      or moe.dispatch_of(cfg) != "blocked_fused"):
    return blocks, none
  experts = tuple({k: b["ffn"][k] for k in _ROUTED} for b in blocks)
  rest = tuple(dict(b, ffn={k: v for k, v in b["ffn"].items() if k not in _ROUTED})
               for b in blocks)
  return rest, experts


def forward_hidden(cfg: ModelConfig, params, tokens, positions=None):
  """tokens [batch, seq] -> (final-normed hidden [batch, seq, embed], router logits).

  Router logits: tuple over cycle positions of [num_cycles, batch*seq, experts] float32
  (None entries for dense models), for an auxiliary load-balancing loss.
  """
  b, t = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  x = jnp.take(params["embed"], tokens, axis=0).astype(cfg.jnp_dtype)
  x = common.constrain(x, ("batch", "activation_length", "activation_embed"))
  x, router, _ = _run_layers(cfg, params, x, positions)
  return norm.rms_norm(x, params["final_norm"], cfg.rms_norm_eps), router


def logits_from_hidden(cfg: ModelConfig, params, hidden):
  """hidden [..., embed] -> float32 logits [..., vocab]."""
  w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  return jnp.dot(hidden.astype(cfg.jnp_dtype), w.astype(cfg.jnp_dtype),
                 preferred_element_type=jnp.float32)


def token_logprobs(cfg: ModelConfig, params, hidden, targets, temperature: float = 1.0):
  """Log-probability and entropy of `targets` under the LM head, position by position.

  Args:
    hidden: [batch, seq, embed] final-normed hidden states (`forward_hidden`).
    targets: [batch, seq] int32, the token each position predicts.
    temperature: a Python float (a traced one takes plain autodiff, without the saving below).
  Returns:
    (logprobs [batch, seq] f32, entropy [batch, seq] f32) of softmax(logits / temperature).

  The gradient is written by hand (`_head_logprobs`): it keeps the hidden states, the entropy
  and the log-sum-exp and recomputes the float32 logits in the backward pass, where autodiff
  would keep the [positions, vocab] float32 log-softmax from the forward pass to the backward
  (at 32k tokens of vocabulary, 128 KiB a position). With `cfg.logits_chunk > 0` the
  vocabulary-sized logits exist for one block of positions at a time, forward and backward: at
  248k tokens of vocabulary they would otherwise be the largest activation of a long-context
  step.
  """
  w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  if isinstance(temperature, jax.core.Tracer):   # a traced temperature: plain autodiff
    head = lambda h, w, y: _head_logprobs_fwd(temperature, h, w, y)[0]
  else:
    head = functools.partial(_head_logprobs, float(temperature))
  # The head is split by vocabulary (Megatron-LM's vocabulary-parallel head): each device takes
  # a block's positions whole and its share of the vocabulary, so the logits and their
  # cotangent never cross devices, only [positions, embed] and the per-position sums do. Left to
  # itself, under context parallelism XLA summed each block's [positions, vocab] logits over the
  # weight's split embed dimension and gathered their cotangent (35B-A3B's step on 16 H200: 97k
  # of its 201k GiB of collectives a GPU, compiler figures). The weight is laid out so once a
  # micro-batch (an all-to-all of its shards); the casts stay inside each block, so with float32
  # weights the blocks' weight gradients are summed in float32.
  w = common.constrain(w, (None, "activation_vocab"))
  block = lambda h, y: head(
      common.constrain(h.astype(cfg.jnp_dtype), ("batch", None, "activation_embed")),
      w.astype(cfg.jnp_dtype), common.constrain(y, ("batch", None)))
  b, t = targets.shape
  chunk = cfg.logits_chunk
  if not chunk or t <= chunk:
    return block(hidden, targets)
  groups = common.split_ways("batch")
  if groups > 1 and b % groups == 0:
    block = _grouped_head_block(cfg, head, w, groups)
  n = -(-t // chunk)
  pad = n * chunk - t
  # Block j holds positions j, j + n, j + 2n, ...: spread evenly along the row, so a row split
  # over devices by position (context parallelism) gives every device its share of each block.
  # Contiguous blocks would each live on one device, and every device would compute the
  # vocabulary-sized logits of every block (16x the LM head's work on 16 devices, compiled).
  h = jnp.pad(hidden, [(0, 0), (0, pad), (0, 0)]).reshape(b, chunk, n, -1)
  y = jnp.pad(targets, [(0, 0), (0, pad)]).reshape(b, chunk, n)
  lp, ent = jax.lax.map(lambda a: block(*a), (jnp.moveaxis(h, 2, 0), jnp.moveaxis(y, 2, 0)))
  unblock = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, n * chunk)[:, :t]
  return unblock(lp), unblock(ent)


def _grouped_head_block(cfg: ModelConfig, head, w, groups: int):
  """`token_logprobs`' block of positions when its rows are split over `groups` sets of devices
  (the `batch` axis): the rows as [groups, rows / groups, ...], each group with its own copy of
  the weight [groups, embed, vocab].

  A block's weight gradient is a sum over its rows. With one weight, XLA sums it over the
  groups' devices inside the loop over blocks, once a block: on 35B-A3B's 16 H200 (a row a
  node) the float32 [embed, vocab / 8] gradient crossed the nodes 80 times a micro-batch,
  2,425 GiB a GPU a step (compiler figures, docs/results.md). Each copy's gradient adds up
  over the blocks on its own devices, and the copies are summed once, after the loop (the
  transpose of the broadcast)."""
  wk = common.constrain(jnp.broadcast_to(w, (groups,) + w.shape),
                        ("batch", None, "activation_vocab"))

  def block(h, y):
    rows = h.shape[0]
    hk = common.constrain(h.astype(cfg.jnp_dtype).reshape(groups, rows // groups, *h.shape[1:]),
                          ("batch", None, None, "activation_embed"))
    yk = common.constrain(y.reshape(groups, rows // groups, *y.shape[1:]), ("batch", None, None))
    lp, ent = head(hk, wk.astype(cfg.jnp_dtype), yk)
    return lp.reshape(y.shape), ent.reshape(y.shape)
  return block


def _head_logits(temperature, h, w):
  """float32 logits / temperature (`logits_from_hidden`'s matmul): the forward's, and the
  backward's recomputation. A block [batch, positions, vocab] is laid out split by vocabulary
  (`token_logprobs`); with a weight a group of rows [groups, embed, vocab] (`_grouped_head_block`),
  h is [groups, rows, positions, embed] and each group meets its own."""
  if w.ndim == 3:
    z = jnp.einsum("k...e,kev->k...v", h, w, preferred_element_type=jnp.float32) / temperature
    return common.constrain(z, ("batch", None, None, "activation_vocab")) if z.ndim == 4 else z
  z = jnp.dot(h, w, preferred_element_type=jnp.float32) / temperature
  return common.constrain(z, ("batch", None, "activation_vocab")) if z.ndim == 3 else z


def _head_stats(temperature, h, w, targets):
  """(log p(target), entropy, log-sum-exp) [...] of z = h @ w / temperature, float32.

  With m = max z, s0 = sum exp(z - m) and s1 = sum exp(z - m) (z - m): log-sum-exp = m + log s0
  and entropy = log s0 - s1 / s0. s0 and s1 reduce the same input to the same shape, so XLA
  makes them one kernel: the [.., vocab] logits are read twice (max, then both sums), where
  log_softmax followed by the entropy's sum over p log p reads them three times (the slice of
  35B-A3B on one H200: 16 GB of float32 logits a micro-batch, compiler figures)."""
  z = _head_logits(temperature, h, w)
  m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  e = jnp.exp(z - m)
  s0 = jnp.sum(e, axis=-1)
  s1 = jnp.sum(e * (z - m), axis=-1)
  lse = m[..., 0] + jnp.log(s0)
  if common.split_ways("activation_vocab") > 1:
    # A masked sum: the vocabulary is split over devices (`token_logprobs`), and a gather from
    # it would be gathered whole first.
    picked = jnp.sum(jnp.where(_is_target(z, targets), z, 0.0), axis=-1) - lse
  else:  # a gather (the masked sum took 256 KiB more a token of XLA:CPU's temporaries)
    picked = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0] - lse
  return picked, jnp.log(s0) - s1 / s0, lse


def _is_target(z, targets):
  """[..., vocab] bool: where the vocabulary index is the position's target."""
  return jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == targets[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head_logprobs(temperature, h, w, targets):
  """(log p(target), entropy) [...] of softmax(h @ w / temperature); h [..., embed], w
  [embed, vocab] in the activation dtype, targets [...] int32, temperature a Python float."""
  return _head_logprobs_fwd(temperature, h, w, targets)[0]


def _head_logprobs_fwd(temperature, h, w, targets):
  picked, entropy, lse = _head_stats(temperature, h, w, targets)
  return (picked, entropy), (h, w, targets, entropy, lse)


def _head_logprobs_bwd(temperature, residuals, cotangents):
  """With p = softmax(z), z = logits / temperature: d log p_y / dz = onehot(y) - p and
  d entropy / dz = -p (log p + entropy); the logits' cotangent is dz / temperature.

  The cotangent is computed in float32 and meets the head's two matmuls in the activation dtype
  (h's), as the forward matmul's operands do, accumulating in float32. Autodiff's transpose
  would keep it float32, and the bfloat16 operand would be upcast to meet it: on a GPU both
  matmuls then ran as float32 GEMMs over [positions, vocab], the largest of a step at 248k
  tokens of vocabulary, and the cotangent took twice the bytes. Rounding it to bfloat16 is
  what a bfloat16 LM head's backward gives in MaxText and Megatron-LM; with float32
  activations (the CPU default) nothing changes."""
  h, w, targets, entropy, lse = residuals
  g_picked, g_entropy = cotangents
  logp = _head_logits(temperature, h, w) - lse[..., None]
  p = jnp.exp(logp)
  onehot = _is_target(logp, targets)
  dz = (jnp.where(onehot, g_picked[..., None], 0.0) - p * g_picked[..., None]
        - g_entropy[..., None] * p * (logp + entropy[..., None]))
  d_logits = (dz / temperature).astype(h.dtype)
  if w.ndim == 3:   # a weight a group of rows (`_grouped_head_block`)
    h_bar = jnp.einsum("k...v,kev->k...e", d_logits, w,
                       preferred_element_type=jnp.float32).astype(h.dtype)
    w_bar = jnp.einsum("k...e,k...v->kev", h, d_logits,
                       preferred_element_type=jnp.float32).astype(w.dtype)
    return common.after(h_bar, w_bar), w_bar, None
  lead = tuple(range(h.ndim - 1))
  h_bar = jax.lax.dot_general(d_logits, w, (((h.ndim - 1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32).astype(h.dtype)
  w_bar = jax.lax.dot_general(h, d_logits, ((lead, lead), ((), ())),
                              preferred_element_type=jnp.float32).astype(w.dtype)
  # The layers' backward pass starts from h_bar; it waits for w_bar too, so the float32
  # [positions, vocab] cotangent is freed first. Otherwise XLA leaves the weight gradient's
  # matmul to the end of the step and keeps that cotangent through the whole backward pass
  # (the ~1B model at remat=full on an H200: 128 of 522 KiB a token).
  return common.after(h_bar, w_bar), w_bar, None


_head_logprobs.defvjp(_head_logprobs_fwd, _head_logprobs_bwd)


def forward(cfg: ModelConfig, params, tokens, *, return_router_logits: bool = False):
  """tokens int32 [batch, seq] -> float32 logits [batch, seq, vocab] (and router logits)."""
  hidden, router = forward_hidden(cfg, params, tokens)
  logits = logits_from_hidden(cfg, params, hidden)
  return (logits, router) if return_router_logits else logits


# -- incremental decoding -----------------------------------------------------------------

def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> dict:
  """An empty decode cache for `batch` sequences of up to `max_len` tokens.

  {"pos": [batch] int32 (tokens cached so far), "blocks": tuple over cycle positions of
   attention: {"k", "v": [cycles, batch, max_len, kv_heads, head_dim]}
   linear:    {"conv": [cycles, batch, kernel-1, conv_dim], "ssm": [cycles, batch, v_heads, d_v, d_k] f32}}
  Only attention layers grow with max_len; the GDN state is constant in context length.
  """
  dt = jnp.dtype(dtype or cfg.dtype)
  n = cfg.num_cycles
  blocks = []
  for layer_type in cfg.cycle:
    if layer_type == FULL:
      kv = (n, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
      blocks.append({"k": jnp.zeros(kv, dt), "v": jnp.zeros(kv, dt)})
    else:
      blocks.append({
          "conv": jnp.zeros((n, batch, cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim), dt),
          "ssm": jnp.zeros((n, batch, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
                            cfg.linear_key_head_dim), jnp.float32)})
  return {"pos": jnp.zeros((batch,), jnp.int32), "blocks": tuple(blocks)}


def cache_axes(cfg: ModelConfig) -> dict:
  """Logical axis names of `init_cache`'s leaves."""
  blocks = []
  for layer_type in cfg.cycle:
    if layer_type == FULL:
      kv = ("layers", "batch", "activation_length", "kv_heads", "head_dim")
      blocks.append({"k": kv, "v": kv})
    else:
      blocks.append({"conv": ("layers", "batch", "conv_kernel", "gdn_qkv"),
                     # d_v, d_k unnamed: one logical name may appear once per array
                     "ssm": ("layers", "batch", "gdn_heads", None, None)})
  return {"pos": ("batch",), "blocks": tuple(blocks)}


def prefill(cfg: ModelConfig, params, tokens, lengths, max_len: int):
  """Runs right-padded prompts and returns their caches.

  Args:
    tokens: [batch, seq] int32, each row valid on [0, lengths[i]).
    lengths: [batch] int32, >= 1.
    max_len: capacity of the returned KV cache (>= seq).
  Returns:
    (logits at each row's last valid token [batch, vocab] float32, cache with pos = lengths).
  """
  b, t = tokens.shape
  cache = init_cache(cfg, b, max_len)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  x = jnp.take(params["embed"], tokens, axis=0).astype(cfg.jnp_dtype)
  x, _, blocks = _run_layers(cfg, params, x, positions, cache=cache, lengths=lengths)
  last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
  last = norm.rms_norm(last, params["final_norm"], cfg.rms_norm_eps)
  return logits_from_hidden(cfg, params, last), {"pos": lengths.astype(jnp.int32), "blocks": blocks}


def prefill_extend(cfg: ModelConfig, params, prefix_cache, tokens, lengths):
  """Continues cached prefixes with right-padded tokens and returns the caches of the whole.

  Args:
    prefix_cache: a `prefill` cache whose KV length is exactly its prefix length P (every row
      holds P tokens: pos == P).
    tokens: [batch, seq] int32 at positions [P, P + seq), each row valid on [0, lengths[i]).
    lengths: [batch] int32, >= 1.
  Returns:
    (logits at each row's last valid token [batch, vocab] float32, cache of KV length P + seq
    with pos = P + lengths): what `prefill` of the prefix and tokens together returns, up to
    float rounding, without recomputing the prefix.
  """
  return _continue(cfg, params, prefix_cache, tokens, lengths, "extend")


def prefill_append(cfg: ModelConfig, params, cache, tokens, lengths):
  """Continues decode-layout caches (a finished turn's slot) with right-padded tokens, in place.

  Args:
    cache: an `init_cache`-layout cache holding `pos` tokens a row, KV capacity max_len >=
      pos + seq (the caller's guarantee).
    tokens: [batch, seq] int32 at positions [pos, pos + seq), each row valid on [0, lengths[i]).
    lengths: [batch] int32, >= 1.
  Returns:
    (logits at each row's last valid token [batch, vocab] float32, the cache (same shapes) with
    pos + lengths tokens): what `prefill` of the cached tokens and these together returns, up
    to float rounding (the cached part may come from decode steps, i.e. the recurrent rule).
  """
  return _continue(cfg, params, cache, tokens, lengths, "append")


def _continue(cfg: ModelConfig, params, cache, tokens, lengths, mode: str):
  """Runs right-padded tokens at positions pos.. after `cache` ("extend" or "append" layout)."""
  t = tokens.shape[1]
  positions = cache["pos"][:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  x = jnp.take(params["embed"], tokens, axis=0).astype(cfg.jnp_dtype)
  x, _, blocks = _run_layers(cfg, params, x, positions, cache=cache, lengths=lengths, mode=mode)
  last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
  last = norm.rms_norm(last, params["final_norm"], cfg.rms_norm_eps)
  pos = cache["pos"] + lengths.astype(jnp.int32)
  return logits_from_hidden(cfg, params, last), {"pos": pos, "blocks": blocks}


def decode_step(cfg: ModelConfig, params, cache, tokens, live=None):
  """Appends one token per row. tokens [batch] int32 -> (logits [batch, vocab] f32, cache).

  live: optional [batch] bool. A row where it is False keeps its Gated DeltaNet states (conv
  and S) exactly as they were: its step neither decays nor writes them, as a padded position
  of a prefill does. Its key and value are still written at its `pos`, past its tokens, and
  `pos` still advances (the caller keeps what it needs). Masking inside the layer costs
  nothing, where selecting old or new states after the step keeps the old stacks alive through
  it: XLA then copies every stacked state before the step and reads both after it."""
  pos = cache["pos"]
  x = jnp.take(params["embed"], tokens[:, None], axis=0).astype(cfg.jnp_dtype)
  lengths = None if live is None else live.astype(jnp.int32)
  x, _, blocks = _run_layers(cfg, params, x, pos[:, None], cache=cache, lengths=lengths,
                             mode="decode")
  x = norm.rms_norm(x[:, 0], params["final_norm"], cfg.rms_norm_eps)
  return logits_from_hidden(cfg, params, x), {"pos": pos + 1, "blocks": blocks}


def cache_insert(decode_cache, prefix_cache, slot, row: int = 0):
  """Copies row `row` of `prefix_cache` into row `slot` of `decode_cache`.

  KV tensors of the prefix may be shorter than the decode cache's (prefill bucket < max_len);
  they are written at the start of the slot and the rest of the slot is zeroed.
  """
  def put(dst, src, batch_axis):
    src = jax.lax.dynamic_index_in_dim(src, row, axis=batch_axis, keepdims=True)
    if src.shape != dst.shape[:batch_axis] + (1,) + dst.shape[batch_axis + 1:]:
      pad = [(0, d - s) if i != batch_axis else (0, 0)
             for i, (d, s) in enumerate(zip(dst.shape, src.shape))]
      src = jnp.pad(src, pad)
    return jax.lax.dynamic_update_index_in_dim(dst, src.astype(dst.dtype), slot, axis=batch_axis)

  blocks = jax.tree.map(lambda d, s: put(d, s, 1), decode_cache["blocks"], prefix_cache["blocks"])
  return {"pos": put(decode_cache["pos"], prefix_cache["pos"], 0), "blocks": blocks}


def cache_row(decode_cache, row):
  """Row `row` of a decode cache as a batch-1 cache of the same capacity (a slot's state)."""
  take = lambda x, axis: jax.lax.dynamic_index_in_dim(x, row, axis=axis, keepdims=True)
  return {"pos": take(decode_cache["pos"], 0),
          "blocks": jax.tree.map(lambda x: take(x, 1), decode_cache["blocks"])}


# -- sizes ----------------------------------------------------------------------------------

def count_params(cfg: ModelConfig) -> dict:
  """Total and active parameter counts, from shapes only (nothing is allocated).

  Convention: `active` counts the weights one token touches in a forward pass: every dense
  weight, the LM head, the router, the shared expert and top_k of num_experts routed experts;
  the input embedding table is excluded from `active` (a lookup, not a matmul) unless it is
  tied to the LM head. `total` counts every stored weight once.
  """
  # The key is made inside the trace: no device is touched and no backend starts (launch.py
  # counts before a mode runs, and a compile-only job sets its devices up after that).
  shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  total, routed = 0, 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    size = math.prod(leaf.shape)
    total += size
    if any(getattr(k, "key", None) in ("wi_gate", "wi_up", "wo") for k in path):
      routed += size
  embed = cfg.vocab_size * cfg.hidden_size
  active = total - routed
  if cfg.use_moe:
    active += routed * cfg.num_experts_per_tok // cfg.num_experts
  if not cfg.tie_word_embeddings:
    active -= embed
  return {"total": total, "active": active, "embedding": embed, "routed_experts": routed}


# -- Hugging Face checkpoints ---------------------------------------------------------------

def load_hf(path, dtype=jnp.float32, shardings=None, **overrides):
  """Reads a local Hugging Face directory -> (ModelConfig, params). Never touches the network.

  `shardings` (a Sharding per param): each device reads only its own shard (hf_io.load_sharded).
  """
  if shardings is not None:
    return hf_io.load_sharded(path, shardings, init_params, dtype=dtype, **overrides)
  return hf_io.load(path, init_params, dtype=dtype, **overrides)


def save_hf(cfg: ModelConfig, params, path, **kw):
  """Writes the weights and a text-only config.json of a Hugging Face checkpoint directory
  (hf_io.save; `max_shard_bytes=`, `extras=`). The complete directory, tokenizer and generation
  defaults included, is envs.chat.hf_export.save_hf."""
  return hf_io.save(cfg, params, path, **kw)


def config_from_dict(model_config) -> ModelConfig:
  """The `config.model` ConfigDict section -> ModelConfig (its resolved fields; `preset` is a
  record, its values already the defaults of those fields: models/presets.py)."""
  return config_lib.from_config_dict(model_config.to_dict() if hasattr(model_config, "to_dict")
                                     else model_config)
