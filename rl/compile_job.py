"""Compiles the job's programs for an accelerator slice from this CPU: `--mode=compile`.

    python launch.py --mode=compile --config=configs/qwen3_5_35b_a3b.py --config.compile.target=h200:2x8
    python launch.py --mode=compile --config=configs/qwen3_5_35b_a3b.py:v5p --config.compile.target=v5p:2x2x4

For the config's mesh over the target's compile-only devices (models/aot.py), it lowers and
compiles every program the job runs there, exactly as the run builds them:
  rl_step     the GRPO train step (rl/train_step.TrainStep: the recipe's micro-batches, remat,
              row length, context parallelism, the KL reference when on), for the step's
              prompts x samples rows of compile.seq_len (or train.seq_len) tokens;
  sft_step    the SFT step (rl/sft.py) where the config trains one (sft.steps > 0), params
              sharded by the same rules;
  engine/...  the rollout engine's programs (rl/rollout/engine.QwenEngine.lower_programs): a
              prefill and an insert per prompt bucket and the generate step, at the slots the
              capacity planner gives, on one host's devices (the engine of a serve job and the
              one in the trainer's process are both per-process engines; `rollout.mesh_shape`
              decides their mesh).
For each it prints per-device memory against the device's HBM (fits or not), the FLOPs counted
from the compiled HLO against the model FLOPs of the same tokens, collectives by kind with their
bytes (on a GPU target of several hosts also those between hosts), and on TPU XLA's time
estimate with the MFU it implies (a compiler estimate). A compile that runs out of device memory
is a result ("does not fit: needs X GiB of Y"). The last line is JSON, like the other modes.

Nothing is allocated: parameters, optimizer state and batches are ShapeDtypeStructs with the
run's shardings. TPU needs `libtpu`, GPU the CUDA plugin: `make setup-compile`.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from models import aot
from models import config as config_lib
from models import qwen3_5
from models import sharding
from models.layers import attention
from rl import plan
from rl import reductions
from rl import sft
from rl import train_step
from rl.rollout import capacity

GiB = aot.GiB


# ----------------------------------------------------------------------------- model FLOPs


def model_flops(mc, rows: int, seq: int, passes: float = 3.0) -> float:
  """Model FLOPs of `passes` matmul passes over rows x seq tokens (3 = forward + backward, 1 =
  forward): 2 x active params per token per pass, plus causal attention's scores and values
  (2 x 2 x seq^2 / 2 x heads x head_dim a row per attention layer per pass). Embedding lookups
  are not matmuls and are not counted (qwen3_5.count_params' `active`)."""
  active = qwen3_5.count_params(mc)["active"]
  n_attn = sum(1 for t in mc.layer_types if t == "full_attention")
  attn = n_attn * rows * 2.0 * seq * seq * mc.num_attention_heads * mc.head_dim
  return passes * (2.0 * active * rows * seq + attn)


def rl_step_model_flops(config, mc, rows: int, seq: int) -> float:
  """The RL step's model FLOPs: forward + backward of every row, plus a forward for the
  recomputed old logprobs (rl.recompute_old_logprobs) and one for the KL reference."""
  passes = 3.0 + (1.0 if config.rl.recompute_old_logprobs else 0.0) + (
      1.0 if config.rl.kl.coef else 0.0)
  return model_flops(mc, rows, seq, passes)


# ----------------------------------------------------------------------------- programs


def _sds(shape, dtype, sh) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sh)


def rl_step_program(config, mesh, seq_len: int):
  """(Lowered, model FLOPs, what) of the GRPO train step for abstract state and batch."""
  step = train_step.TrainStep(config, mesh)
  rows = int(config.train.prompts_per_step) * int(config.train.samples_per_prompt)
  layout = {"tokens": ((rows, seq_len), jnp.int32), "loss_mask": ((rows, seq_len), jnp.int32),
            "rollout_logprobs": ((rows, seq_len), jnp.float32),
            "rewards": ((rows,), jnp.float32), "group_ids": ((rows,), jnp.int32),
            "valid": ((rows,), jnp.bool_)}
  shapes = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in layout.items()}
  shardings = step.batch_shardings(shapes)
  batch = {k: _sds(s.shape, s.dtype, shardings[k]) for k, s in shapes.items()}
  lowered = step.lower(step.abstract_state(), batch)
  flops = rl_step_model_flops(config, step.model_cfg, rows, seq_len)
  what = (f"{rows} rows x {seq_len} tokens, {config.train.mini_batches} mini-batch(es) of "
          f"{step.micro_batches(rows // int(config.train.mini_batches))} micro-batches, "
          f"remat={config.model.remat}")
  return lowered, flops, what


def sft_step_program(config, mesh, seq_len: int):
  """(Lowered, model FLOPs, what) of the SFT step with params sharded by the config's rules."""
  rules = sharding.rules_from_config(config.mesh.rules)
  mc = qwen3_5.config_from_dict(config.model)
  opt = sft.sft_optimizer(config)
  p_shapes = jax.eval_shape(lambda k: qwen3_5.init_params(mc, k), jax.random.key(0))
  p_sh = sharding.tree_shardings(qwen3_5.param_axes(mc), p_shapes, mesh, rules)
  o_shapes = jax.eval_shape(opt.init, p_shapes)
  o_sh = optax.tree_map_params(opt, lambda _, sh: sh, o_shapes, p_sh,
                               transform_non_params=lambda _: sharding.replicated(mesh))
  rows = int(config.sft.batch_size)
  bsh = lambda nd: sharding.batch_sharding(mesh, rules, nd, rows)
  batch = {"tokens": _sds((rows, seq_len), jnp.int32, bsh(2)),
           "loss_mask": _sds((rows, seq_len), jnp.int32, bsh(2)),
           "lengths": _sds((rows,), jnp.int32, bsh(1))}
  ways = sharding.ways(mesh.shape, rules, "batch")
  step, _ = sft.sft_steps(config, mc, opt, backend=mesh.devices.flat[0].platform, batch_ways=ways)
  with sharding.use_mesh(mesh, rules):
    lowered = step.lower(sharding.with_shardings(p_shapes, p_sh),
                         sharding.with_shardings(o_shapes, o_sh), batch, None)
  micro = reductions.micro_batch_count(rows, int(config.sft.micro_batches), ways)
  return (lowered, model_flops(mc, rows, seq_len),
          f"{rows} rows x {seq_len} tokens in {micro} micro-batch(es)")


def engine_programs(config, devices, buckets) -> tuple[dict, dict]:
  """({name: Lowered}, facts) of the rollout engine on one host's `devices`."""
  from rl.rollout import engine as engine_lib  # lazy: JetStream, only when the engine compiles
  eng = engine_lib.QwenEngine.from_config(config, devices=devices)
  lowered = eng.lower_programs(buckets or (max(eng.buckets),))
  mesh = eng.programs.mesh
  n_dev = int(mesh.devices.size) if mesh is not None else 1
  # The capacity planner's view of the same engine (rl/rollout/capacity.py): weights and every
  # slot's decode state at max_len, spread over the engine's devices. The compiled generate
  # step holds exactly these as its arguments; the planner sees no activations.
  p = capacity.plan_from_config(config, len(devices))
  planned = (p.weight_bytes + eng.slots * p.bytes_per_seq) / n_dev
  facts = {"slots": eng.slots, "max_len": eng.max_len, "devices": n_dev,
           "planner_bytes_per_device": int(planned), "planner_slots": p.per_engine}
  return lowered, facts


# ----------------------------------------------------------------------------- compile


def compile_one(name: str, lowered, spec: aot.DeviceSpec, n_devices: int,
                flops: Optional[float] = None, hosts=None, kernel_lines: int = 0) -> dict:
  """Compiles one lowered program and analyses it; out of memory is a result, not a raise.
  `hosts`: each device's host in the program's device order (`aot.hlo_costs`), or None.
  `kernel_lines`: also the source lines whose kernels take longest (`aot.kernel_lines`)."""
  t0 = time.time()
  row: dict[str, Any] = {"program": name}
  try:
    compiled = aot.compile_lowered(lowered)
  except Exception as e:  # pylint: disable=broad-except
    oom = aot.out_of_memory(e)
    if oom is None:
      raise
    row.update(fits=False, out_of_memory=oom, compile_s=round(time.time() - t0, 1))
    return row
  row["compile_s"] = round(time.time() - t0, 1)
  row.update(aot.analyse(compiled, spec, hosts, kernel_lines))
  if flops:
    row["model_flops"] = flops
    # The HLO's FLOPs are per device; the model's are the whole step's.
    row["flops_ratio"] = row["flops"] * n_devices / flops
    if row.get("estimated_seconds"):
      row["estimated_mfu"] = flops / (row["estimated_seconds"] * n_devices * spec.peak_bf16_flops)
    if row.get("roofline_seconds"):
      row["roofline_mfu"] = flops / (row["roofline_seconds"] * n_devices * spec.peak_bf16_flops)
  return row


def _gib(b) -> str:
  return "?" if b is None else f"{b / GiB:.1f}"


def format_row(row: dict, spec: aot.DeviceSpec) -> str:
  """One program's report, a few lines."""
  lines = [f"{row['program']}: {row.get('what', '')}"]
  if "out_of_memory" in row:
    oom = row["out_of_memory"]
    lines.append(f"  does not fit: needs {_gib(oom['needed'])} GiB of {_gib(oom['available'])} "
                 f"GiB a device (the compiler ran out of memory; compile {row['compile_s']} s)")
    return "\n".join(lines)
  m = row["memory"]
  lines.append(
      f"  memory/device: {_gib(m['total'])} GiB of {_gib(row['hbm_bytes'])} "
      f"({'fits' if row['fits'] else 'DOES NOT FIT'}): arguments {_gib(m['argument'])}, outputs "
      f"{_gib(m['output'])}, aliased {_gib(m['alias'])}, temporaries {_gib(m['temp'])} GiB"
      f"  (compile {row['compile_s']} s)")
  flops = f"  FLOPs/device (HLO, loops counted): {row['flops']:.3e}"
  if row.get("model_flops"):
    flops += f"; x devices / model FLOPs = {row['flops_ratio']:.2f}"
  lines.append(flops)
  if row["collectives"]:
    lines.append("  collectives/device: " + ", ".join(
        f"{k} {v['count']} x, {v['bytes'] / GiB:.2f} GiB" for k, v in row["collectives"].items()))
    between = {k: v["between_hosts"] for k, v in row["collectives"].items() if "between_hosts" in v}
    if between:
      lines.append("  of which between hosts: " + ", ".join(
          f"{k} {b / GiB:.2f} GiB" for k, b in between.items() if b) + (
          f" ({sum(between.values()) / GiB:.0f} of "
          f"{sum(v['bytes'] for v in row['collectives'].values()) / GiB:.0f} GiB)"))
  if row.get("estimated_seconds"):
    mfu = row.get("estimated_mfu")
    lines.append(f"  compiler estimate: {row['estimated_seconds']:.3f} s a step"
                 + (f", MFU {100 * mfu:.1f}% of {spec.peak_bf16_flops / 1e12:.0f} TFLOP/s" if mfu else ""))
  if spec.platform == "cuda":   # on a TPU the whole program is one launch
    lines.append(f"  kernels/device a step (launches, loops counted): {row['kernels']:,}")
    lines.append(f"  host syncs a step (conditionals, loop tests XLA cannot count): "
                 f"{row['host_syncs']:,}")
    mfu = row.get("roofline_mfu")
    lines.append(f"  roofline estimate: {1e3 * row['roofline_seconds']:,.1f} ms a step"
                 + (f" (MFU at most {100 * mfu:.1f}%)" if mfu else "")
                 + f", HBM traffic {row['traffic_bytes'] / GiB:,.1f} GiB: each kernel the slower "
                 f"of its matmuls at their dtype's peak and its bytes at HBM bandwidth; no launch "
                 f"gaps")
    for k in row.get("kernel_lines", []):
      lines.append(f"    {1e3 * k['seconds']:9.2f} ms {k['launches']:8,} x  "
                   f"{k['flops'] / 1e12:8.2f} TFLOP {k['bytes'] / GiB:8.1f} GiB  {k['where']}")
  calls = {k: v for k, v in row["custom_calls"].items()
           if "cudnn" in k or "cublas" in k or "triton" in k}
  if calls:
    lines.append("  library calls: " + ", ".join(f"{k} x{v}" for k, v in calls.items()))
  if row.get("unknown_trip_counts"):
    lines.append(f"  loops counted once (trip count unknown): {len(row['unknown_trip_counts'])}")
  return "\n".join(lines)


def _host_devices(devices: list) -> list:
  """The devices of the first host (process 0): a per-process engine's devices."""
  first = [d for d in devices if getattr(d, "process_index", 0) == getattr(devices[0], "process_index", 0)]
  return first or devices[:1]


def mesh_for_target(axes, shape, num_devices: int) -> tuple[tuple, str]:
  """(mesh shape, note) of the config's mesh on a target of `num_devices` devices.

  The configured shape when it fits. Otherwise `fsdp` takes the difference: the model-parallel
  axes (`expert`, `tensor`), which the layers' shapes constrain, keep their sizes, then `data`
  folds into `fsdp`, then `expert` and `tensor` shrink to what divides the devices. A user
  compiling a config for a larger or smaller slice than it names gets that slice's mesh and a
  note saying so; a shape that fits no way is a MeshError naming the sizes."""
  axes, shape = tuple(axes), tuple(int(s) for s in shape)
  try:
    return sharding.resolve_mesh_shape(axes, shape, num_devices), ""
  except sharding.MeshError as first:
    if "fsdp" not in axes or len(axes) != len(shape) or any(s == 0 or s < -1 for s in shape):
      raise
    error = first
  size = dict(zip(axes, (max(s, 1) for s in shape)))
  expert, tensor = size.get("expert", 1), size.get("tensor", 1)
  shrunk_tensor = math.gcd(tensor, num_devices)
  shrunk_expert = math.gcd(expert, num_devices // shrunk_tensor)
  for sizes in ({**size, "fsdp": -1}, {**size, "data": 1, "fsdp": -1},
                {**size, "data": 1, "fsdp": -1, "expert": shrunk_expert, "tensor": shrunk_tensor}):
    candidate = tuple(sizes[a] if a in sizes else 1 for a in axes)
    try:
      fitted = sharding.resolve_mesh_shape(axes, candidate, num_devices)
    except sharding.MeshError:
      continue
    return fitted, (f"mesh.shape {shape} does not fit the target's {num_devices} devices "
                    f"({error}); compiling with mesh.shape {fitted} (fsdp takes the difference; "
                    f"--config.mesh.shape chooses another)")
  raise error


def run(config, target: str, programs=None) -> list[dict]:
  """Compiles `programs` (default compile.programs) of `config` for `target`; returns rows.

  The model is traced as for the target's platform (models/config.compiling_for): its
  per-backend "auto" choices (attention implementation and causal blocks, the Gated DeltaNet
  chunk, the MoE dispatch) are those of a run on those devices, not of this CPU. The config's
  mesh is fitted to the target's device count (mesh_for_target)."""
  t = aot.parse_target(target)
  devices = aot.target_devices(str(t))
  config = config.copy_and_resolve_references()   # the caller's config stays as given
  shape, note = mesh_for_target(config.mesh.axes, config.mesh.shape, len(devices))
  if note:
    print(f"note: {note}", flush=True)
  with config.unlocked():
    config.mesh.shape = shape
    config.plan.num_devices = len(devices)
  if attention.stands_in_for_cudnn(qwen3_5.config_from_dict(config.model),
                                   devices[0].platform):
    print("note: attention compiled as Pallas' flash attention (model.attention_impl=pallas) "
          "in place of cuDNN's, which needs the cuDNN library to compile", flush=True)
    with config.unlocked():
      config.model.attention_impl = "pallas"
  with config_lib.compiling_for(devices[0].platform):
    return _run(config, t, devices, programs)


def _run(config, t: aot.Target, devices: list, programs) -> list[dict]:
  spec = t.spec
  programs = tuple(programs or config.compile.programs)
  unknown = set(programs) - {"rl_step", "sft_step", "engine"}
  if unknown:
    raise ValueError(f"compile.programs: unknown {sorted(unknown)}; use rl_step, sft_step, engine")
  mesh = sharding.make_mesh(config.mesh, devices)
  seq = int(config.compile.seq_len) or int(config.train.seq_len)
  rows = []

  # On a GPU cluster the links between hosts are the slow ones: the report splits them out.
  hosts = [d.process_index for d in mesh.devices.flat]
  hosts = hosts if spec.platform == "cuda" and len(set(hosts)) > 1 else None

  def add(name, lowered, flops, what, n_dev, **extra):
    row = compile_one(name, lowered, spec, n_dev, flops,
                      hosts if name in ("rl_step", "sft_step") else None,
                      int(config.compile.kernel_lines) if spec.platform == "cuda" else 0)
    row.update(what=what, **extra)
    rows.append(row)
    print(format_row(row, spec), flush=True)

  print(f"compiling for {t} ({aot.describe(devices)}, {_gib(spec.hbm_bytes)} GiB each), "
        f"mesh {sharding.describe(mesh)}", flush=True)
  if "rl_step" in programs:
    lowered, flops, what = rl_step_program(config, mesh, seq)
    # --mode=plan's analytic bytes for the same step (rl/plan.py), beside the compiler's.
    p = plan.memory_plan(config, len(devices), [seq])
    parts = {"params": p["params"], "grads": p["grads"], "opt": p["opt"],
             "ref_params": p["ref_params"], "activations": p["activations"][0][1]["total"]}
    add("rl_step", lowered, flops, what, len(devices), plan_bytes=int(sum(parts.values())),
        plan_parts={k: int(v) for k, v in parts.items()})
    row = rows[-1]
    if "memory" in row:
      print(f"  --mode=plan says {_gib(row['plan_bytes'])} GiB a device (params "
            f"{_gib(parts['params'])}, gradients {_gib(parts['grads'])}, optimizer "
            f"{_gib(parts['opt'])}, activations {_gib(parts['activations'])}): compiled / plan = "
            f"{row['memory']['total'] / row['plan_bytes']:.2f}", flush=True)
  if "sft_step" in programs and int(config.sft.steps) > 0:
    sft_len = int(config.sft.pad_multiple) or seq
    lowered, flops, what = sft_step_program(config, mesh, sft_len)
    add("sft_step", lowered, flops, what, len(devices))
  if "engine" in programs:
    host = _host_devices(devices)
    if int(config.compile.engine_devices):
      host = host[:int(config.compile.engine_devices)]
    try:
      lowered, facts = engine_programs(config, host, tuple(config.compile.engine_buckets))
    except (sharding.MeshError, ValueError) as e:
      # An engine is one process's: its mesh must fit one host (rollout.mesh_shape).
      rows.append({"program": "engine", "error": str(e)})
      print(f"engine: not compiled: {e}", flush=True)
      return rows
    what = (f"{facts['slots']} slots x {facts['max_len']} tokens on {facts['devices']} "
            f"device(s)")
    for name, low in lowered.items():
      add(f"engine/{name}", low, None, what, facts["devices"], **facts)
    gen = rows[-1]
    if "memory" in gen:
      print(f"  capacity planner: {_gib(facts['planner_bytes_per_device'])} GiB a device of "
            f"weights and decode state for {facts['slots']} slots (room for "
            f"{facts['planner_slots']}); the compiled generate step's arguments: "
            f"{_gib(gen['memory']['argument'])} GiB", flush=True)
  return rows


def main(config, flags=None):
  del flags
  if not config.compile.target:
    raise SystemExit("--mode=compile needs a target: --config.compile.target=KIND:SHAPE "
                     f"(KIND one of {sorted(aot.DEVICES)}; e.g. v5p:2x2x4 or h200:2x8)")
  rows = run(config, config.compile.target)
  slim = [{k: v for k, v in r.items() if k not in ("custom_calls",)} for r in rows]
  print(json.dumps({"target": config.compile.target, "programs": slim}))
