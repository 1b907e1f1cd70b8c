"""Memory plan of the train step at full scale, computed from shapes only.

    python launch.py --mode=plan --config=configs/qwen3_5_397b_a17b.py

Prints, per device of the configured mesh, the bytes of parameters, gradients, optimizer
state and an activation estimate, and says whether the total fits the device memory. Shapes
come from `jax.eval_shape` (of the model's init and of the optimizer's init) and per-leaf
shardings from the logical-axis rules on an abstract mesh of the configured shape, so nothing
is allocated and no device of that size needs to exist: it runs on a laptop CPU.

The activation estimate is counted from shapes, part by part (`part_bytes`): what each layer
kind keeps from its forward to its backward pass (the RMSNorms, the Gated DeltaNet's and the
attention's projections, the MoE's dispatched rows) and the working set of one part's backward
(the recomputed Gated DeltaNet chunks, one block of attention scores, one gathered expert
matrix a block, the LM head's float32 logits and their cotangent). Under remat=none every
layer's kept bytes stay; under remat=full each layer cycle's input, and the cycle being
recomputed. benchmarks/activation_memory.py compiles each part and the whole step for the
CPU and an H200 and prints these beside the compiler's figures (docs/model.md, "Activation
memory"); the step is modelled on the platform of `plan.device_kind` (its attention
implementation, Gated DeltaNet chunk and, on XLA:CPU, float32 copies of 16-bit activations and
weights). It is printed per micro-batch for several sequence lengths. With context parallelism
(`activation_length` mapped to mesh axes) each row's per-token terms are divided over those
axes' devices and attention adds the row's gathered keys and values; on host devices the
measured split saved about half what this model says (docs/model.md, "Context parallelism is a
sharding rule").

With LoRA (lora.rank > 0, models/lora.py) the params are the frozen base (model.param_dtype,
no gradient, no optimizer state) plus the adapters, and gradients and AdamW moments are the
adapters' alone; the base's merged weights add to the activations (`lora_terms`).

Below the train step it prints the rollout engine's side (rl/rollout/capacity.py), for a serve
job and for an engine in the trainer's process, which leaves the train step what this plan says
it holds (`rollout.capacity.sharing_devices`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

from models import config as config_lib
from models import lora
from models import qwen3_5
from models import sharding
from models.layers import attention
from models.layers import gated_deltanet
from models.layers import moe
from rl import reductions
from rl import train_step
from rl.rollout import capacity

GiB = 1024 ** 3


def _abstract_mesh(config, num_devices: int) -> AbstractMesh:
  shape = sharding.resolve_mesh_shape(config.mesh.axes, config.mesh.shape, num_devices)
  return AbstractMesh(shape, tuple(config.mesh.axes), axis_types=(AxisType.Auto,) * len(shape))


def _leaves(axes_tree, shapes) -> list:
  """(logical axes, ShapeDtypeStruct) of every param."""
  return jax.tree.leaves(jax.tree.map(
      lambda a, s: (a, s), axes_tree, shapes, is_leaf=lambda x: isinstance(x, tuple) and all(
          isinstance(e, str) or e is None for e in x)), is_leaf=lambda x: isinstance(x, tuple)
      and len(x) == 2 and isinstance(x[1], jax.ShapeDtypeStruct))


def _shard_elements(axes, sds, mesh, rules) -> int:
  """Elements of one device's shard of a param (rounded up), shards from the logical rules."""
  spec = sharding.logical_to_spec(axes, rules, mesh, sds.shape)
  n = 1
  for dim, target in zip(sds.shape, tuple(spec) + (None,) * (len(sds.shape) - len(spec))):
    ways = 1 if target is None else math.prod(
        mesh.shape[t] for t in ((target,) if isinstance(target, str) else target))
    n *= -(-dim // ways)
  return n


def _per_device_bytes(shapes, axes_tree, mesh, rules, dtype_override=None) -> int:
  """Sum over leaves of ceil(shard size) * itemsize, shards from the logical rules."""
  return sum(_shard_elements(axes, sds, mesh, rules)
             * jnp.dtype(dtype_override or sds.dtype).itemsize
             for axes, sds in _leaves(axes_tree, shapes))


def memory_plan(config, num_devices: int, seq_lens=None) -> dict:
  """Per-device byte counts for the configured model, optimizer, batch and mesh."""
  mc = qwen3_5.config_from_dict(config.model)
  mesh = _abstract_mesh(config, num_devices)
  rules = sharding.rules_from_config(config.mesh.rules)
  axes = qwen3_5.param_axes(mc)
  p_shapes = jax.eval_shape(functools.partial(qwen3_5.init_params, mc), jax.random.key(0))
  tx = train_step.make_optimizer(config.optim, config.train.steps)
  trained = p_shapes
  if "lora" in config and config.lora.rank:
    trained = jax.eval_shape(lambda k: lora.init(lora.from_config(config.lora), axes, p_shapes, k),
                             jax.random.key(0))
  o_shapes = jax.eval_shape(tx.init, trained)
  n_param_like = sum(1 for _ in jax.tree.leaves(o_shapes) if _.ndim > 0)
  n_params = len(jax.tree.leaves(trained))
  if n_param_like != 2 * n_params:
    raise ValueError(f"expected AdamW state = 2 moments per param, found {n_param_like} "
                     f"array leaves for {n_params} params")

  params = _per_device_bytes(p_shapes, axes, mesh, rules)
  spec = lora.from_config(config.lora) if "lora" in config else None
  lora_plan = lora_terms(spec, mc, axes, p_shapes, mesh, rules) if spec else None
  # What is trained: the params, or with LoRA the adapters.
  t_shapes, t_axes = ((p_shapes, axes) if spec is None
                      else (lora_plan["shapes"], lora_plan["axes"]))
  batch_ways = sharding.ways(mesh.shape, rules, "batch")
  rows = config.train.prompts_per_step * config.train.samples_per_prompt
  rows_mini = rows // config.train.mini_batches
  micro = reductions.micro_batch_count(rows_mini, int(config.train.micro_batches), batch_ways)
  # Gradients are accumulated in float32 across micro-batches (params' dtype without them).
  grads = _per_device_bytes(t_shapes, t_axes, mesh, rules, jnp.float32 if micro > 1 else None)
  # Optimizer moments: each param-shaped leaf of the optimizer state, sharded like its param.
  mu_bytes = _per_device_bytes(t_shapes, t_axes, mesh, rules, config.optim.mu_dtype)
  nu_bytes = _per_device_bytes(t_shapes, t_axes, mesh, rules)
  opt = mu_bytes + nu_bytes
  # The KL penalty's frozen reference policy: a second copy of the params, sharded like them
  # (with LoRA the reference is the base itself).
  ref = params if config.rl.kl.coef and spec is None else 0

  counts = qwen3_5.count_params(mc)
  length_ways = sharding.ways(mesh.shape, rules, "activation_length")
  tensor_ways = mesh.shape.get("tensor", 1)
  rows_mb = rows_mini // micro
  # Rows per group of devices that splits one row (context parallelism; one device without).
  rows_dev = rows_mb / batch_ways
  # The platform the step runs on: the one being compiled for (rl/compile_job.py traces inside
  # models/config.compiling_for), else plan.device_kind's: its attention implementation,
  # Gated DeltaNet chunk and (XLA:CPU) float32 copies, not this machine's.
  platform = getattr(config_lib._TARGET, "platform", None) or platform_of(config.plan.device_kind)  # pylint: disable=protected-access
  act = []
  for t in (seq_lens or [config.train.seq_len]):
    a = activation_bytes(mc, t, max(rows_dev, 1.0), tensor_ways, length_ways, platform)
    if lora_plan:   # the merged weights: kept for the backward pass, or one cycle's at a time
      a["lora_merged"] = lora_plan["merged_kept" if mc.remat != "full" else "merged_cycle"]
      a["total"] += a["lora_merged"]
    act.append((t, a))
  if lora_plan:
    params += lora_plan["adapters"]
  return {"mesh": dict(mesh.shape), "num_devices": num_devices, "counts": counts,
          "lora": lora_plan and {k: v for k, v in lora_plan.items() if k not in ("shapes", "axes")},
          "params": params, "grads": grads, "opt": opt, "ref_params": ref, "activations": act,
          "rows_per_device": rows_dev, "rows_per_micro_batch": rows_mb, "micro_batches": micro,
          "length_ways": length_ways, "platform": platform}


def lora_terms(spec, mc, axes, p_shapes, mesh, rules) -> dict:
  """LoRA's bytes a device: the adapters (float32, sharded like their weights: models/lora.py),
  the frozen base's share, and the merged weights the layer scan makes (models/qwen3_5.py):
  with remat=none the backward pass keeps every layer's (one more copy of the adapted weights,
  in the base's dtype), with remat=full one layer cycle's at a time. Also the adapters' shapes
  and axes, which the gradients and optimizer state take."""
  a_shapes = jax.eval_shape(lambda k: lora.init(spec, axes, p_shapes, k), jax.random.key(0))
  a_axes = lora.axes(spec, axes)
  adapted = set(lora.adapted_paths(spec, axes))
  leaves = jax.tree_util.tree_flatten_with_path(p_shapes)[0]
  flat_axes = dict(zip([jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in leaves],
                       (a for a, _ in _leaves(axes, p_shapes))))
  merged = sum(_shard_elements(flat_axes[name], sds, mesh, rules) * jnp.dtype(sds.dtype).itemsize
               for name, sds in ((jax.tree_util.keystr(p, simple=True, separator="/"), s)
                                 for p, s in leaves) if name in adapted)
  return {"shapes": a_shapes, "axes": a_axes, "rank": spec.rank,
          "adapters": _per_device_bytes(a_shapes, a_axes, mesh, rules),
          "adapter_count": sum(math.prod(x.shape) for x in jax.tree.leaves(a_shapes)),
          "merged_kept": merged, "merged_cycle": merged // max(mc.num_cycles, 1)}


# Per-token float32 tensors the Gated DeltaNet layer's backward pass holds at its peak (the
# recomputed chunked rule: q, k, v, their chunked, decayed and UT-solved forms, the backward
# scan's stacked cotangents), counted in the H200 compile's buffer assignment of one layer at
# the ~1B benchmark shape (benchmarks/activation_memory.py): ~16 of [tokens, v_heads * d_v],
# ~7 of [tokens, v_heads, chunk] (decays, the triangular systems and their inverses) and 1.5
# of the per-chunk states.
_GDN_WORKING_VALUE_F32 = 16
_GDN_WORKING_CHUNK_F32 = 7
_GDN_WORKING_STATES = 1.5
# What a Gated DeltaNet layer keeps besides when its mixer is not recomputed
# (`model.gdn_recompute=False`): ~9 float32 [tokens, v_heads * d_v] tensors, ~6 of [tokens,
# v_heads, chunk] and 1.5 of the per-chunk states, fitted to the compiled "kept a layer" of
# benchmarks/activation_memory.py at three shapes (the ~1B on this CPU and for an H200, the
# smoke size; each within 2%). The backward then no longer makes them: `working` less as much.
_GDN_KEPT_VALUE_F32 = 9
_GDN_KEPT_CHUNK_F32 = 6
_GDN_KEPT_STATES = 1.5
# Bytes an attention score element costs while its block's backward runs: the float32
# logits, the float32 softmax and the 16-bit probabilities (the H200 compile of one attention
# layer, XLA's attention over one 2048-token block: 9.9 bytes).
_SCORE_BYTES = 10


def platform_of(device_kind: str) -> str:
  """The JAX platform of a `plan.device_kind` label: cpu, tpu (a "TPU ..." name) or gpu."""
  kind = str(device_kind).lower()
  return "cpu" if kind == "cpu" else "tpu" if "tpu" in kind else "gpu"


def _held_itemsize(mc, platform: str) -> int:
  """Bytes of one kept activation element. XLA:CPU computes 16-bit floats in float32 and keeps
  the float32 copies for the backward pass: each layer kind's kept bytes there are twice an
  H200's (benchmarks/activation_memory.py: attention 31.9 vs 15.5 KiB a token, Gated
  DeltaNet 21.1 vs 10.0, RMSNorm 4.0 vs 2.0)."""
  ab = jnp.dtype(mc.dtype).itemsize
  return 4 if platform == "cpu" and ab < 4 else ab


def part_bytes(mc, seq: int, rows: float, tensor_ways: int = 1, length_ways: int = 1,
               platform: str | None = None) -> dict:
  """What each part of the train step holds, for `rows` rows of `seq` tokens on one device.

  {part: {"kept": bytes one such layer keeps from its forward to its backward pass,
          "working": bytes its backward holds besides, one layer at a time}}
  for attention, gated_deltanet, moe (or mlp), rms_norm and lm_head_logprobs. Each is
  counted from what the code keeps (models/layers/*, the hand-written and recomputed
  gradients); benchmarks/activation_memory.py compiles each part and prints these beside the
  compiler's figures. `platform` (default: the one traced for, models/config.platform) picks
  the attention implementation, the Gated DeltaNet chunk and XLA:CPU's float32 copies.
  """
  platform = platform or config_lib.platform()
  with config_lib.compiling_for(platform):
    impl = attention.resolve_impl(mc)
    block = attention.causal_block(mc)
    chunk = gated_deltanet.chunk_size(mc)
  ab = _held_itemsize(mc, platform)
  tok = rows * seq / length_ways
  tw = tensor_ways
  h = mc.hidden_size
  out = {}
  # RMSNorm: x and one float32 a row (models/layers/norm.py); its backward, x in float32.
  out["rms_norm"] = {"kept": (h * ab + 4) * tok, "working": h * 4 * tok}
  # Gated DeltaNet: the input projections' input and outputs (the conv's input, z, beta and
  # the decay input) and the mixer's output; the rest is recomputed (gated_deltanet._mix),
  # or with model.gdn_recompute=False kept (`mixer`).
  nv, dk, dv = mc.linear_num_value_heads, mc.linear_key_head_dim, mc.linear_value_head_dim
  conv, value = mc.gdn_conv_dim / tw, mc.gdn_value_dim / tw
  # The per-chunk states, a token: float32, or as `gdn_scan=fused` stores them
  # (`model.gdn_storage_dtype`; the value-sized terms are left at float32, an upper bound).
  states = nv / tw * dk * dv * jnp.dtype(mc.gdn_storage_dtype).itemsize / chunk
  mixer = 0.0 if mc.gdn_recompute else (_GDN_KEPT_VALUE_F32 * value * 4 + _GDN_KEPT_STATES * states
                                        + _GDN_KEPT_CHUNK_F32 * nv / tw * chunk * 4) * tok
  out["gated_deltanet"] = {
      "kept": (h + conv + 2 * value + 2 * nv / tw) * ab * tok + mixer,
      "working": (_GDN_WORKING_VALUE_F32 * value * 4 + _GDN_WORKING_CHUNK_F32 * nv / tw * chunk * 4
                  + _GDN_WORKING_STATES * states + 2 * conv * ab) * tok - mixer}
  # Attention: the projections' input; q before its norm and after RoPE, the sigmoid gate, its
  # derivative, the attention output and the gated output; k before its norm and after RoPE,
  # v. Scores are recomputed in the backward pass, one causal block (or query chunk) at a
  # time: the last and largest, [rows, heads, block, seq]; cuDNN's flash attention keeps none.
  # Pallas' (models/layers/flash_attention.py) keeps its log-sum-exp and the key and value
  # heads repeated for every query head; its backward adds a float32 per query head and token
  # and writes dk, dv for every query head before the repeat's gradient sums each group.
  nh, kvh, hd = mc.num_attention_heads / tw, mc.num_key_value_heads / tw, mc.head_dim
  query = mc.attention_query_chunk if 0 < mc.attention_query_chunk < seq else 0
  block = block if 0 < block < seq else seq
  repeated_kv = repeated_kv_grads = 0.0
  if impl == "cudnn" and not query:
    scores = rows * nh * seq * 4 * 2 / length_ways         # its softmax statistics
  elif impl == "pallas":
    scores = rows * nh * seq * 4 * 2 / length_ways
    repeated_kv = 2 * (nh - kvh) * hd * ab * tok
    repeated_kv_grads = 2 * nh * hd * ab * tok
  else:
    scores = rows * max(nh, 1) * (query or block) * seq * _SCORE_BYTES / length_ways
  gathered_kv = 2 * kvh * hd * rows * seq * ab if length_ways > 1 else 0
  out["attention"] = {"kept": (h + (6 * nh + 3 * kvh) * hd) * ab * tok + repeated_kv,
                      "working": scores + gathered_kv + repeated_kv_grads, "scores": scores}
  if mc.use_moe:
    out["moe"] = _moe_bytes(mc, tok, ab, tw)
  else:
    f = mc.intermediate_size / tw
    out["mlp"] = {"kept": (h + 4 * f) * ab * tok, "working": 0.0}
  # LM head: its input, target, entropy and log-sum-exp; the backward recomputes the float32
  # logits and holds their float32 cotangent beside them, for logits_chunk positions of each row
  # at a time.
  logit_rows = rows * (mc.logits_chunk if 0 < mc.logits_chunk < seq else seq) / length_ways
  out["lm_head_logprobs"] = {"kept": (h * ab + 12) * tok,
                             "working": logit_rows * mc.vocab_size / tw * 4 * 2}
  return out


def _moe_bytes(mc, tok: float, ab: int, tw: int) -> dict:
  """The sparse MoE as models/layers/moe.py computes it (blocked dispatch): kept, per token,
  its input (and the router's float32 copy, the router probabilities), per dispatched row (the
  rows of the expert-blocked layout, padded per expert to whole blocks) the row, its bool mask
  and six [rows, expert_mlp] tensors of the SwiGLU (the two matmuls, the SiLU terms, their
  product), the top-k combined rows, the shared expert's six [tokens, mlp] tensors; working,
  one expert matrix gathered per block of a step of the matmul loop (`moe.blocks_per_step`;
  recomputed in the backward pass)."""
  h, e, k = mc.hidden_size, mc.num_experts, mc.num_experts_per_tok
  f, fs = mc.moe_intermediate_size / tw, mc.shared_expert_intermediate_size / tw
  pairs = max(int(tok) * k, 1)
  block = moe.block_size(pairs, e, mc.moe_block_size)
  blocks = max(1, (pairs + min(e, pairs) * (block - 1)) // block)
  rows = blocks * block
  per_token = h * ab + h * 4 + e * 4 + k * h * ab + 6 * fs * ab
  per_row = h * ab + h + 6 * f * ab
  # The step as the model picks it, from the whole weight's shape (the grouped dispatch's).
  step = moe.blocks_per_step(mc, blocks, (e, h, mc.moe_intermediate_size), ab)
  return {"kept": per_token * tok + per_row * rows, "working": step * h * f * ab}


def activation_bytes(mc, seq: int, rows: float, tensor_ways: int, length_ways: int = 1,
                     platform: str | None = None) -> dict:
  """Activation bytes of one micro-batch on one device, from `part_bytes`.

  saved: what the backward pass keeps across layers (remat none: every layer's kept bytes,
    two RMSNorms, the mixer and the feed-forward each; remat full: each layer cycle's input),
    and the LM head's input.
  working: the layers' backward pass beyond that: the largest working set of one part, and
    under remat full the kept bytes of the one cycle being recomputed.
  attn_scores: the attention part of `working` (one block of scores), shown on its own.
  logits: the LM head's backward (float32 logits and their cotangent), which runs before the
    layers' and so beside `saved` alone.
  cpu_float32_copies: on XLA:CPU with 16-bit params, the float32 copies of every weight and of
    its gradient that the compiled step holds whatever the tokens (2 x 4 bytes a parameter;
    the ~1B model's ~7.8 GiB), zero elsewhere: not activations, but temporaries of the step.
  total: saved + max(working, logits) + cpu_float32_copies.
  `length_ways`: devices each row's tokens are split over (context parallelism); attention
  then also holds the row's gathered keys and values.
  """
  platform = platform or config_lib.platform()
  parts = part_bytes(mc, seq, rows, tensor_ways, length_ways, platform)
  ffn = parts["moe" if mc.use_moe else "mlp"]
  mixer = {"linear_attention": parts["gated_deltanet"], "full_attention": parts["attention"]}
  layer = lambda t: 2 * parts["rms_norm"]["kept"] + mixer[t]["kept"] + ffn["kept"]
  head = parts["lm_head_logprobs"]["kept"] + parts["rms_norm"]["kept"]     # and the final norm
  ab = _held_itemsize(mc, platform)
  if mc.remat == "full":
    saved = mc.num_cycles * rows * seq / length_ways * mc.hidden_size * ab + head
    recomputed = sum(layer(t) for t in mc.cycle)
  else:
    saved = sum(layer(t) for t in mc.layer_types) + head
    recomputed = 0.0
  kinds = set(mc.cycle)
  layer_working = max([ffn["working"], parts["rms_norm"]["working"]]
                      + [mixer[t]["working"] for t in kinds])
  working = recomputed + layer_working
  scores = parts["attention"]["scores"] if "full_attention" in kinds else 0.0
  logits = parts["lm_head_logprobs"]["working"]
  copies = 0
  if platform == "cpu" and jnp.dtype(mc.param_dtype).itemsize < 4:
    copies = 2 * 4 * qwen3_5.count_params(mc)["total"]
  return {"saved": saved, "working": working, "attn_scores": scores, "logits": logits,
          "cpu_float32_copies": copies, "total": saved + max(working, logits) + copies}


def _fmt(b: float) -> str:
  return f"{b / GiB:10.2f} GiB"


def format_plan(config, plan: dict) -> str:
  hbm = config.plan.device_memory_gib * GiB
  lines = []
  c = plan["counts"]
  lines.append(f"Memory plan: {config.name}  model preset={config.model.preset or '(fields)'}")
  lines.append(f"  parameters: total {c['total'] / 1e9:.2f} B, active {c['active'] / 1e9:.2f} B "
               f"per token; param dtype {config.model.param_dtype}, compute {config.model.dtype}")
  mesh = " x ".join(f"{k}={v}" for k, v in plan["mesh"].items())
  lines.append(f"  mesh: {mesh}  ({plan['num_devices']} devices of {config.plan.device_kind}, "
               f"{config.plan.device_memory_gib:.0f} GiB each)")
  lines.append(f"  batch: {config.train.prompts_per_step} prompts x {config.train.samples_per_prompt} "
               f"samples, {config.train.mini_batches} mini-batch(es), {plan['micro_batches']} "
               f"micro-batch(es)"
               + (f" (train.micro_batches={config.train.micro_batches} would split rows unevenly "
                  "over the devices)" if plan["micro_batches"] != config.train.micro_batches else "")
               + f": {plan['rows_per_micro_batch']} rows per micro-batch, "
               f"{plan['rows_per_device']:.2f} per device"
               + (f" group of {plan['length_ways']} (each row split over them: context parallel)"
                  if plan["length_ways"] > 1 else "") + f"; remat={config.model.remat}")
  if plan["rows_per_device"] < 1:
    lines.append("  note: fewer rows in a mini-batch than devices along the batch axes; those "
                 "devices idle or duplicate work (use more rows or fewer devices on the batch)")
  static = plan["params"] + plan["grads"] + plan["opt"] + plan["ref_params"]
  lines.append("")
  lines.append(f"  {'per device':28s}{'bytes':>14s}")
  lo = plan.get("lora")
  if lo:
    lines.append(f"  {'params (frozen base)':28s}{_fmt(plan['params'] - lo['adapters'])}")
    lines.append(f"  {'LoRA adapters (float32)':28s}{_fmt(lo['adapters'])}  rank {lo['rank']}, "
                 f"{lo['adapter_count'] / 1e6:.1f} M parameters")
    lines.append(f"  {'gradients (adapters)':28s}{_fmt(plan['grads'])}")
  else:
    lines.append(f"  {'params':28s}{_fmt(plan['params'])}")
    lines.append(f"  {'gradients':28s}{_fmt(plan['grads'])}")
  lines.append(f"  {'optimizer (AdamW mu, nu)':28s}{_fmt(plan['opt'])}")
  if plan["ref_params"]:
    lines.append(f"  {'reference params (KL)':28s}{_fmt(plan['ref_params'])}")
  lines.append(f"  {'static total':28s}{_fmt(static)}")
  lines.append("")
  lines.append(f"  activations ({plan.get('platform', 'cpu')}): saved + the larger of working (of "
               f"which attn scores) and logits" + (" + XLA:CPU's float32 copies of the weights "
               "and gradients" if any(a["cpu_float32_copies"] for _, a in plan["activations"])
               else "") + (" + LoRA's merged weights (" + ("one layer cycle's" if
                           config.model.remat == "full" else "every layer's, kept")
                           + f": {_fmt(plan['activations'][0][1]['lora_merged']).strip()})"
                           if lo else ""))
  lines.append(f"  {'seq len':>9s} {'saved':>14s} {'working':>14s} {'attn scores':>14s} "
               f"{'logits':>14s} {'activations':>14s} {'total':>14s}  fits?")
  for t, a in plan["activations"]:
    total = static + a["total"]
    ok = "yes" if total <= hbm else "NO"
    lines.append(f"  {t:9d} {_fmt(a['saved'])} {_fmt(a['working'])} {_fmt(a['attn_scores'])} "
                 f"{_fmt(a['logits'])} {_fmt(a['total'])} {_fmt(total)}  {ok} "
                 f"({100 * total / hbm:.0f}% of {config.plan.device_memory_gib:.0f} GiB)")
  return "\n".join(lines)


def train_step_bytes_per_device(config, num_devices: int = 0) -> int:
  """What the train step holds on each of its devices at its peak (`memory_plan`, from shapes:
  params, gradients, optimizer state, activations of a train.seq_len micro-batch)."""
  p = memory_plan(config, num_devices or jax.device_count(), [config.train.seq_len])
  return p["params"] + p["grads"] + p["opt"] + p["ref_params"] + p["activations"][0][1]["total"]


def weight_sync_bytes_per_host(config, num_devices: int, num_processes: int) -> int:
  """Bytes one weight sync brings to each host when every process's rollout engine serves from
  that process's own devices (rl/distributed.host_copy): each param's bytes (param dtype) that
  the host's devices do not hold, from the mesh's logical rules, the host holding
  num_devices / num_processes of the devices, each with distinct shards. 0 for one process,
  where the engine copies device to device."""
  if num_processes <= 1:
    return 0
  mc = qwen3_5.config_from_dict(config.model)
  mesh = _abstract_mesh(config, num_devices)
  rules = sharding.rules_from_config(config.mesh.rules)
  shapes = jax.eval_shape(functools.partial(qwen3_5.init_params, mc), jax.random.key(0))
  per_host = num_devices // num_processes
  moved = 0
  for axes, sds in _leaves(qwen3_5.param_axes(mc), shapes):
    whole = math.prod(sds.shape)
    held = min(whole, _shard_elements(axes, sds, mesh, rules) * per_host)
    moved += (whole - held) * jnp.dtype(sds.dtype).itemsize
  return int(moved)


def _size(b: float) -> str:
  return f"{b / GiB:.2f} GiB" if b >= GiB / 4 else f"{b / 2**20:.2f} MiB"


def format_rollout_plan(config, num_devices: int) -> str:
  """The rollout engine's side (rl/rollout/capacity.py): its mesh, served weights, decode state
  per sequence at rollout.max_len, and its slots and kept turns. An engine in the trainer's
  process shares these devices with the train step; a serve job has them to itself."""
  shape = capacity.engine_mesh_shape(config, num_devices)
  p = capacity.plan_from_config(config, num_devices)
  r = config.rollout
  mesh = " x ".join(f"{k}={v}" for k, v in zip(config.mesh.axes, shape))
  lines = [f"Rollout engine: mesh {mesh} ({math.prod(shape)} devices; rollout.mesh_shape), "
           f"max_len {r.max_len} (train.max_context {config.train.max_context})",
           f"  weights {_size(p.weight_bytes)} ({r.weights_dtype or config.model.param_dtype}), "
           f"decode state {_size(p.bytes_per_seq)} a sequence (KV {_size(p.kv_bytes_per_seq)}, "
           f"Gated DeltaNet {_size(p.gdn_bytes_per_seq)}); engine memory "
           f"{_size(p.engine_memory_bytes)} (rollout.capacity.memory_fraction {r.capacity.memory_fraction})"]
  shared = capacity.sharing_devices(
      config, lambda: train_step_bytes_per_device(config, num_devices), num_devices)
  for where, c in (("as a serve job", config), ("in the trainer's process", shared)):
    held = c.rollout.capacity.reserve_gib - r.capacity.reserve_gib
    fit = capacity.plan_from_config(c, num_devices).per_engine
    line = f"  {where}" + (f" (the train step holds {held:.2f} GiB of these devices)"
                           if held else "") + f": {fit} sequences fit; "
    try:
      slots = capacity.engine_slots(c, num_devices)
      line += f"slots {slots}" + (" (rollout.slots)" if r.slots else
                                  f" (planner, capped at rollout.max_slots {r.max_slots})")
      line += f", kept turns {r.turn_cache} (rollout.turn_cache)"
    except ValueError as e:
      line += f"does NOT fit: {e}"
    lines.append(line)
  return "\n".join(lines)


def main(config, flags=None):
  """launch.py --mode=plan entry point."""
  del flags
  n = int(config.plan.num_devices) or jax.device_count()
  seq_lens = list(config.plan.seq_lens) or [config.train.seq_len]
  plan = memory_plan(config, n, seq_lens)
  print(format_plan(config, plan))
  print()
  print(format_rollout_plan(config, n))
  hosts = int(config.plan.num_processes) or jax.process_count()
  if hosts > 1:
    print(f"\nweight sync over {hosts} processes of {n // hosts} devices: each host gathers "
          f"{_size(weight_sync_bytes_per_host(config, n, hosts))} a step (the shards its devices "
          f"do not hold, {config.model.param_dtype}; rl/distributed.host_copy)")
  return plan
