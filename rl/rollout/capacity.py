"""Capacity planner: how many sequences an engine can decode at once.

    python -m rl.rollout.capacity                      # the report's two layouts
    plan = capacity.plan(cfg, context_len=160_000, device_memory_gib=80, devices_per_engine=8,
                         memory_fraction=0.85, num_engines=10, tensor_parallel=8,
                         weight_bytes=2, cache_bytes=2)

Decode state of one sequence (models/qwen3_5.init_cache), from shapes only:
  attention layers (1 in 4): K and V, 2 x kv_heads x head_dim x context x cache_bytes each;
      with tensor parallelism past kv_heads every rank keeps whole heads, so the stored heads
      are max(kv_heads, tp) (Qwen3.5 has 2 KV heads: TP 8 stores each head 4 times);
  Gated DeltaNet layers (3 in 4): conv state (kernel-1) x conv_dim x cache_bytes plus the
      recurrent state v_heads x d_k x d_v in float32, constant in context length.
Engine memory = devices x device memory x fraction - weights (each weight times the copies the
engine's layout keeps, `held_params`, x weight_bytes)
- reserve; concurrent sequences = floor(that / per-sequence bytes). The engine allocates
every slot at max_len (no paging), so this is exactly its `max_concurrent_decodes` bound.
"""
import dataclasses
import math
import types

import jax

from configs import base
from models import lora
from models import qwen3_5
from models import sharding
from models.config import FULL

GIB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}


@dataclasses.dataclass
class Plan:
  context_len: int
  kv_bytes_per_seq: int
  gdn_bytes_per_seq: int
  weight_bytes: int
  engine_memory_bytes: int
  free_bytes: int
  per_engine: int
  num_engines: int

  @property
  def bytes_per_seq(self) -> int:
    return self.kv_bytes_per_seq + self.gdn_bytes_per_seq

  @property
  def total(self) -> int:
    return self.per_engine * self.num_engines


def decode_state_bytes(cfg, context_len: int, cache_bytes: int, tensor_parallel: int = 1) -> tuple[int, int]:
  """(KV bytes, GDN state bytes) of one sequence of `context_len` tokens."""
  n_attn = sum(t == FULL for t in cfg.layer_types)
  n_gdn = cfg.num_hidden_layers - n_attn
  heads = max(cfg.num_key_value_heads, tensor_parallel)
  kv = n_attn * 2 * heads * cfg.head_dim * context_len * cache_bytes
  conv = (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * cache_bytes
  ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
  return kv, n_gdn * (conv + ssm)


def plan(cfg, *, context_len: int, device_memory_gib: float, devices_per_engine: int,
         memory_fraction: float, num_engines: int = 1, tensor_parallel: int = 1,
         weight_bytes: int = 0, cache_bytes: int = 0, reserve_gib: float = 0.0,
         num_params: int = 0) -> Plan:
  """Per-engine and total concurrent sequences. 0 bytes = the model's dtypes."""
  weight_bytes = weight_bytes or _DTYPE_BYTES[cfg.param_dtype]
  cache_bytes = cache_bytes or _DTYPE_BYTES[cfg.dtype]
  num_params = num_params or qwen3_5.count_params(cfg)["total"]
  kv, gdn = decode_state_bytes(cfg, context_len, cache_bytes, tensor_parallel)
  mem = int(devices_per_engine * device_memory_gib * GIB * memory_fraction)
  weights = num_params * weight_bytes
  free = mem - weights - int(reserve_gib * GIB)
  per_engine = max(0, free // (kv + gdn))
  return Plan(context_len, kv, gdn, weights, mem, free, int(per_engine), num_engines)


def engine_mesh_shape(config, num_devices: int) -> tuple:
  """The engine's mesh shape (rl/rollout/engine.engine_mesh): `rollout.mesh_shape`, or () =
  `mesh.shape`, its -1 taking what `num_devices` leaves (`models.sharding.MeshError` when they
  do not divide)."""
  shape = tuple(int(n) for n in (tuple(config.rollout.mesh_shape) or tuple(config.mesh.shape)))
  if -1 not in shape:
    return shape
  return sharding.resolve_mesh_shape(config.mesh.axes, shape, num_devices)


def engine_rules(config) -> sharding.Rules:
  """The engine's logical-axis rules (rl/rollout/engine.engine_mesh): `mesh.rules` with whole
  rows (context parallelism is for the train step's long rows; a cache split by position would
  cost a collective at every decoded token) and, with `rollout.whole_weights`, no split of any
  weight's `embed` dimension: the trainer's FSDP rules split every weight so, and each decode
  step would all-gather them all (3.3 GiB a GPU a step for 35B-A3B on 8 H200s, compiled). The
  routed experts stay split by the `experts` rule; whole on every device they would not fit."""
  rules = sharding.without_context_parallel(config.mesh.rules)
  if config.rollout.whole_weights:
    rules = sharding.with_targets(rules, embed=None)
  return rules


def plan_from_config(config, num_devices: int = 0) -> Plan:
  """The plan of the `rollout.capacity` section for `config.model`; devices_per_engine 0 = the
  engine mesh's device count on `num_devices` devices (0 = this machine's), device_memory_gib
  0 = the plan section's. A devices_per_engine given plans an engine of that many devices
  (laid out as `rollout.mesh_shape` on them), whatever this machine has."""
  c = config.rollout.capacity
  cfg = qwen3_5.config_from_dict(config.model)
  if c.devices_per_engine:
    num_devices = c.devices_per_engine
    if engine_devices(config, num_devices) != num_devices:
      raise ValueError(f"rollout.capacity.devices_per_engine={num_devices} but the engine's mesh "
                       f"(rollout.mesh_shape) has {engine_devices(config, num_devices)} devices")
  cache_dtype = config.rollout.cache_dtype or cfg.dtype
  weights_dtype = config.rollout.weights_dtype or cfg.param_dtype
  return plan(cfg, context_len=c.context_len or config.rollout.max_len,
              device_memory_gib=c.device_memory_gib or config.plan.device_memory_gib,
              devices_per_engine=engine_devices(config, num_devices),
              memory_fraction=c.memory_fraction, num_engines=c.num_engines,
              tensor_parallel=c.tensor_parallel,
              weight_bytes=c.weight_bytes or _DTYPE_BYTES[weights_dtype],
              cache_bytes=c.cache_bytes or _DTYPE_BYTES[cache_dtype], reserve_gib=c.reserve_gib,
              num_params=held_params(config, cfg, num_devices))


def held_params(config, cfg, num_devices: int = 0) -> int:
  """Weights the engine's devices hold together (`plan` divides them over the devices): each
  weight once per copy its layout keeps (`engine_rules` on the engine's mesh: a weight split
  over n of the d devices is held d / n times), and with LoRA the base of each adapted weight
  besides the merged one it serves (rl/rollout/engine_weights.py keeps the base to merge each
  sync into)."""
  shapes = jax.eval_shape(lambda k: qwen3_5.init_params(cfg, k), jax.random.key(0))
  axes = qwen3_5.param_axes(cfg)
  spec = lora.from_config(config.lora) if "lora" in config else None
  adapted = set(lora.adapted_paths(spec, axes)) if spec is not None else set()
  sizes = _engine_axis_sizes(config, num_devices)
  mesh = types.SimpleNamespace(shape=sizes)     # what logical_to_spec reads of a mesh
  devices = math.prod(sizes.values())
  rules = engine_rules(config)

  def held(path, names, x):
    split = sharding.logical_to_spec(names, rules, mesh, x.shape)
    ways = math.prod(sizes[a] for t in split for a in sharding.target_axes(t))
    copies = 2 if jax.tree_util.keystr(path, simple=True, separator="/") in adapted else 1
    return copies * math.prod(x.shape) * devices // ways
  return sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map_with_path(
      held, axes, shapes, is_leaf=sharding.is_axes_leaf)))


def _engine_axis_sizes(config, num_devices: int = 0) -> dict:
  """{mesh axis: size} of the engine's mesh on `num_devices` devices (0 = this machine's)."""
  return dict(zip(config.mesh.axes,
                  engine_mesh_shape(config, num_devices or jax.device_count())))


def engine_devices(config, num_devices: int = 0) -> int:
  """Devices of the engine's mesh on `num_devices` devices (0 = this machine's)."""
  return math.prod(engine_mesh_shape(config, num_devices or jax.device_count()))


def engine_slots(config, num_devices: int = 0) -> int:
  """The engine's max_concurrent_decodes: rollout.slots, or the planner's count capped at max_slots.

  A kept turn (rollout.turn_cache, rl/rollout/turn_cache.py) holds one slot's state, so the
  planner's count is shared between decode slots and kept turns.
  """
  if config.rollout.slots:
    return int(config.rollout.slots)
  p = plan_from_config(config, num_devices)
  kept = int(config.rollout.turn_cache)
  if p.per_engine - kept < 1:
    raise ValueError(f"no decode slot of {p.context_len} tokens is left: {p.free_bytes / GIB:.1f} "
                     f"GiB free after weights, {p.bytes_per_seq / GIB:.2f} GiB per sequence, "
                     f"room for {p.per_engine} sequences, of which rollout.turn_cache keeps {kept}")
  return slots_the_mesh_splits(config, min(p.per_engine - kept, config.rollout.max_slots),
                               num_devices)


def slots_the_mesh_splits(config, slots: int, num_devices: int = 0) -> int:
  """`slots` rounded down to a multiple of the engine mesh's ways over the decode state's
  `batch` axis, where there are at least that many. A count the ways do not divide leaves every
  slot's state whole on every device: 35B-A3B's 49 planner slots on 8 H200s compiled to 160.6
  GiB a GPU of generate arguments where the planner counts 27.1 (32 slots: 20.5 both;
  docs/results.md)."""
  shape = _engine_axis_sizes(config, num_devices)
  rules = engine_rules(config)
  ways = sharding.ways(shape, rules, "batch")
  return int(slots - slots % ways if slots >= ways else slots)


# The report's rollout layouts (Mercor x SkyRL): bf16 weights and caches, 160k context.
REPORT_LAYOUTS = (
    dict(name="35B-A3B", preset="qwen3_5_35b_a3b", device="H100 80GB", device_memory_gib=80 * 1e9 / GIB,
         devices_per_engine=8, memory_fraction=0.85, num_engines=10, report=550),
    dict(name="397B-A17B", preset="qwen3_5_397b_a17b", device="H200 141GB",
         device_memory_gib=141 * 1e9 / GIB, devices_per_engine=8, memory_fraction=0.93,
         num_engines=12, report=300),
)


def report_table(context_len: int = 160_000, tp_options=(1, 8)) -> str:
  """The planner's counts for the report's layouts, beside the report's concurrency."""
  lines = [f"context {context_len:,} tokens, bf16 weights and KV/conv, GDN recurrent state f32",
           f"{'model':10} {'layout':24} {'TP':>3} {'weights':>9} {'KV/seq':>9} {'GDN/seq':>8} "
           f"{'free/eng':>9} {'per eng':>8} {'total':>6} {'report':>7} {'avg ctx @report':>15}"]
  for lay in REPORT_LAYOUTS:
    m = base.get_model_config()
    m.preset = lay["preset"]
    cfg = qwen3_5.config_from_dict(m)
    for tp in tp_options:
      p = plan(cfg, context_len=context_len, device_memory_gib=lay["device_memory_gib"],
               devices_per_engine=lay["devices_per_engine"], memory_fraction=lay["memory_fraction"],
               num_engines=lay["num_engines"], tensor_parallel=tp, weight_bytes=2, cache_bytes=2)
      # Mean context each of the report's rollouts could hold if the free memory were shared
      # (paged KV): what the report's concurrency implies.
      per_engine_report = lay["report"] / lay["num_engines"]
      kv_per_token = p.kv_bytes_per_seq / context_len
      avg_ctx = (p.free_bytes / per_engine_report - p.gdn_bytes_per_seq) / kv_per_token
      layout = f"{lay['num_engines']}x(8x {lay['device']}) f={lay['memory_fraction']}"
      lines.append(
          f"{lay['name']:10} {layout:24} {tp:>3} {p.weight_bytes / GIB:>7.0f}Gi "
          f"{p.kv_bytes_per_seq / GIB:>7.2f}Gi {p.gdn_bytes_per_seq / 2**20:>6.0f}Mi "
          f"{p.free_bytes / GIB:>7.0f}Gi {p.per_engine:>8d} {p.total:>6d} {lay['report']:>7d} "
          f"{avg_ctx:>15,.0f}")
  return "\n".join(lines)


def check_context(config) -> None:
  """Raises ValueError unless the engine's slots hold every episode the harness lets grow: the
  harness stops an episode at train.max_context tokens, the engine refuses a prompt past
  rollout.max_len. Said before anything runs."""
  max_len, context = int(config.rollout.max_len), int(config.train.max_context)
  if max_len < context:
    raise ValueError(
        f"rollout.max_len={max_len} < train.max_context={context}: episodes may grow to "
        f"train.max_context tokens but a rollout slot holds rollout.max_len; raise "
        f"rollout.max_len (or lower train.max_context)")


def main():
  print(report_table())


if __name__ == "__main__":
  main()


def sharing_devices(config, train_bytes_per_device, num_devices: int = 0):
  """`config` for an engine in the trainer's process, which serves from the train step's own
  devices: rollout.capacity.reserve_gib grows by what the train step holds on the engine's
  devices, so the planner's slots and kept turns leave it that memory (a serve job has its
  devices to itself). Returned as is when rollout.slots is set (nothing is planned).

  train_bytes_per_device: () -> what the train step holds on each device at its peak
  (rl/plan.py's `train_step_bytes_per_device`), called only when slots are planned.
  """
  if config.rollout.slots:
    return config
  held = engine_devices(config, num_devices) * train_bytes_per_device()
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.rollout.capacity.reserve_gib = float(c.rollout.capacity.reserve_gib) + held / GIB
  return c
