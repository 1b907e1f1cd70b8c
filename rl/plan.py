"""Memory plan of the train step at full scale, computed from shapes only.

    python launch.py --mode=plan --config=configs/qwen3_5_397b_a17b.py

Prints, per device of the configured mesh, the bytes of parameters, gradients, optimizer
state and an activation estimate, and says whether the total fits the device memory. Shapes
come from `jax.eval_shape` (of the model's init and of the optimizer's init) and per-leaf
shardings from the logical-axis rules on an abstract mesh of the configured shape, so nothing
is allocated and no device of that size needs to exist: it runs on a laptop CPU.

The activation estimate is analytic (an upper-bound style model of the current
implementation, not a compiler measurement): saved layer inputs under the configured remat,
the working set of one recomputed layer cycle, the attention score matrices (the attention
layers hold [heads, chunk or seq, seq] float32 scores per block) and the float32 logits of the LM
head. It is printed per micro-batch for several sequence lengths. With context parallelism
(`activation_length` mapped to mesh axes) each row's per-token terms are divided over those
axes' devices and attention adds the row's gathered keys and values; on host devices the
measured split saved about half what this model says (docs/model.md, "Context parallelism is a
sharding rule").

Below the train step it prints the rollout engine's side (rl/rollout/capacity.py), for a serve
job and for an engine in the trainer's process, which leaves the train step what this plan says
it holds (`sharing_the_trainers_devices`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

from models import qwen3_5
from models import sharding
from models.layers import attention
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
  o_shapes = jax.eval_shape(tx.init, p_shapes)
  n_param_like = sum(1 for _ in jax.tree.leaves(o_shapes) if _.ndim > 0)
  n_params = len(jax.tree.leaves(p_shapes))
  if n_param_like != 2 * n_params:
    raise ValueError(f"expected AdamW state = 2 moments per param, found {n_param_like} "
                     f"array leaves for {n_params} params")

  params = _per_device_bytes(p_shapes, axes, mesh, rules)
  # Gradients are accumulated in float32 across micro-batches (params' dtype without them).
  g_dtype = jnp.float32 if config.train.micro_batches > 1 else None
  grads = _per_device_bytes(p_shapes, axes, mesh, rules, g_dtype)
  # Optimizer moments: each param-shaped leaf of the optimizer state, sharded like its param.
  mu_bytes = _per_device_bytes(p_shapes, axes, mesh, rules, config.optim.mu_dtype)
  nu_bytes = _per_device_bytes(p_shapes, axes, mesh, rules)
  opt = mu_bytes + nu_bytes
  # The KL penalty's frozen reference policy: a second copy of the params, sharded like them.
  ref = params if config.rl.kl.coef else 0

  counts = qwen3_5.count_params(mc)
  batch_ways = math.prod(mesh.shape[a] for a in sharding.rule_axes(rules, "batch"))
  length_ways = math.prod(mesh.shape[a] for a in sharding.rule_axes(rules, "activation_length"))
  tensor_ways = mesh.shape.get("tensor", 1)
  rows = config.train.prompts_per_step * config.train.samples_per_prompt
  rows_mb = rows // config.train.mini_batches // config.train.micro_batches
  # Rows per group of devices that splits one row (context parallelism; one device without).
  rows_dev = rows_mb / batch_ways
  act = []
  for t in (seq_lens or [config.train.seq_len]):
    act.append((t, activation_bytes(mc, t, max(rows_dev, 1.0), tensor_ways, length_ways)))
  return {"mesh": dict(mesh.shape), "num_devices": num_devices, "counts": counts,
          "params": params, "grads": grads, "opt": opt, "ref_params": ref, "activations": act,
          "rows_per_device": rows_dev, "rows_per_micro_batch": rows_mb,
          "length_ways": length_ways}


def activation_bytes(mc, seq: int, rows: float, tensor_ways: int, length_ways: int = 1) -> dict:
  """Analytic activation bytes of one micro-batch on one device (see module docstring).
  `length_ways`: devices each row's tokens are split over (context parallelism); attention
  then also holds the row's gathered keys and values."""
  ab = jnp.dtype(mc.dtype).itemsize
  tok = rows * seq / length_ways
  h = mc.hidden_size
  mlp = (mc.num_experts_per_tok * mc.moe_intermediate_size * 3 + mc.shared_expert_intermediate_size * 3
         if mc.use_moe else mc.intermediate_size * 3)
  # Per layer: norms/residuals (~4 h), the MLP expansion, the mixer projections.
  gdn = 2 * mc.gdn_conv_dim + 2 * mc.gdn_value_dim + 4 * mc.linear_num_value_heads
  attn = (3 * mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
  per_layer = {"linear_attention": 4 * h + mlp / tensor_ways + gdn / tensor_ways,
               "full_attention": 4 * h + mlp / tensor_ways + attn / tensor_ways}
  n_attn = sum(1 for t in mc.layer_types if t == "full_attention")
  cycle_ws = sum(per_layer[t] for t in mc.cycle) * tok * ab
  if length_ways > 1:
    gathered_kv = 2 * mc.num_key_value_heads * mc.head_dim * rows * seq * ab
    cycle_ws += sum(1 for t in mc.cycle if t == "full_attention") * gathered_kv
  if mc.remat == "full":
    saved = mc.num_cycles * tok * h * ab
    working = cycle_ws * 2              # forward recompute + backward of one cycle
    scores_layers = sum(1 for t in mc.cycle if t == "full_attention")
  else:
    saved = sum(per_layer[t] for t in mc.layer_types) * tok * ab
    working = cycle_ws
    scores_layers = n_attn
  heads_dev = max(mc.num_attention_heads // tensor_ways, 1)
  # Query-chunked attention holds one [chunk, seq] block of scores at a time; causal blocks
  # hold the lower-triangular blocks only, (n + 1) / 2n of the square with n blocks.
  if 0 < mc.attention_query_chunk < seq:
    score_area = mc.attention_query_chunk * seq
  elif 0 < attention.causal_block(mc) < seq:
    n = -(-seq // attention.causal_block(mc))
    score_area = seq * seq * (n + 1) / (2 * n)
  else:
    score_area = seq * seq
  scores = scores_layers * rows * heads_dev * score_area / length_ways * 4 * 2  # f32 logits + probs
  # f32 logits, log-softmax and their grad, for logits_chunk positions of each row at a time.
  logit_rows = rows * (mc.logits_chunk if 0 < mc.logits_chunk < seq else seq)
  logits = logit_rows / length_ways * mc.vocab_size / tensor_ways * 4 * 3
  return {"saved": saved, "working": working, "attn_scores": scores, "logits": logits,
          "total": saved + working + scores + logits}


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
               f"samples, {config.train.mini_batches} mini-batch(es), {config.train.micro_batches} "
               f"micro-batch(es): {plan['rows_per_micro_batch']} rows per micro-batch, "
               f"{plan['rows_per_device']:.2f} per device"
               + (f" group of {plan['length_ways']} (each row split over them: context parallel)"
                  if plan["length_ways"] > 1 else "") + f"; remat={config.model.remat}")
  if plan["rows_per_device"] < 1:
    lines.append("  note: fewer than one row per device per micro-batch; devices along the batch "
                 "axes idle or duplicate work (use fewer micro-batches)")
  static = plan["params"] + plan["grads"] + plan["opt"] + plan["ref_params"]
  lines.append("")
  lines.append(f"  {'per device':28s}{'bytes':>14s}")
  lines.append(f"  {'params':28s}{_fmt(plan['params'])}")
  lines.append(f"  {'gradients':28s}{_fmt(plan['grads'])}")
  lines.append(f"  {'optimizer (AdamW mu, nu)':28s}{_fmt(plan['opt'])}")
  if plan["ref_params"]:
    lines.append(f"  {'reference params (KL)':28s}{_fmt(plan['ref_params'])}")
  lines.append(f"  {'static total':28s}{_fmt(static)}")
  lines.append("")
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


def sharing_the_trainers_devices(config, num_devices: int = 0):
  """`config` for an engine in the trainer's process, which serves from the train step's own
  devices: rollout.capacity.reserve_gib grows by what the train step holds on the engine's
  devices, so the planner's slots and kept turns leave it that memory (a serve job has its
  devices to itself). Returned as is when rollout.slots is set (nothing is planned)."""
  if config.rollout.slots:
    return config
  held = (capacity.engine_devices(config, num_devices)
          * train_step_bytes_per_device(config, num_devices))
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.rollout.capacity.reserve_gib = float(c.rollout.capacity.reserve_gib) + held / GiB
  return c


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
  shared = sharing_the_trainers_devices(config, num_devices)
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
