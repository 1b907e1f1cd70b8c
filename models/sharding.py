"""Device meshes and logical-axis sharding rules.

The mesh has the axes of `config.mesh.axes` (data, fsdp, expert, tensor) with the sizes of
`config.mesh.shape` (one -1 entry takes all remaining devices). Parameters and activations
carry logical axis names (`models.qwen3_5.param_axes`); `config.mesh.rules` maps each
logical name to zero, one or several mesh axes.

Axis types: every mesh axis is `AxisType.Auto` on purpose. The train step is jitted with
explicit in/out shardings and the model adds `with_sharding_constraint` hints on
activations; GSPMD propagates everything else. (jax.make_mesh's default in 0.10 is Explicit
axes, which would make sharding part of every array's type and reject e.g. a plain matmul of
two differently sharded operands.)

Multi-host: the mesh is built over `jax.devices()` (all processes' devices) and batches are
assembled with `jax.make_array_from_process_local_data`, so nothing assumes one process.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Optional, Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, Any], ...]


class MeshError(ValueError):
  """The configured mesh does not fit the available devices."""


def resolve_mesh_shape(axes: Sequence[str], shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Replaces a single -1 in `shape` and checks that the product equals `num_devices`."""
  axes, shape = tuple(axes), tuple(int(s) for s in shape)
  if len(axes) != len(shape):
    raise MeshError(f"mesh.axes {axes} and mesh.shape {shape} differ in length")
  if shape.count(-1) > 1:
    raise MeshError(f"mesh.shape {shape} has more than one -1")
  if any(s == 0 or s < -1 for s in shape):
    raise MeshError(f"mesh.shape {shape} has a non-positive size")
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise MeshError(f"mesh.shape {dict(zip(axes, shape))} does not fit {num_devices} devices: "
                      f"{num_devices} is not a multiple of {known}")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise MeshError(f"mesh {dict(zip(axes, shape))} needs {math.prod(shape)} devices, but "
                    f"{num_devices} are available ({jax.default_backend()}, "
                    f"{jax.process_count()} process(es))")
  return shape


def make_mesh(mesh_cfg, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A mesh with Auto axes from the `config.mesh` section, over all (global) devices."""
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_cfg.axes, mesh_cfg.shape, len(devices))
  axis_types = (AxisType.Auto,) * len(shape)
  return jax.make_mesh(shape, tuple(mesh_cfg.axes), axis_types=axis_types, devices=devices)


def rules_from_config(rules: Iterable) -> Rules:
  """config.mesh.rules (lists from the command line or tuples) -> a hashable tuple of rules."""
  out = []
  for name, target in rules:
    if isinstance(target, (list, tuple)):
      target = tuple(target) if len(target) != 1 else target[0]
    out.append((str(name), target))
  return tuple(out)


def rule_axes(rules: Iterable, logical: str) -> tuple:
  """The mesh axes `rules` map the logical axis `logical` to, as a tuple (() = none)."""
  # The first rule for `logical` (later ones are fallbacks for arrays whose other dimensions
  # took its axes).
  return target_axes(next((t for name, t in rules_from_config(rules) if name == logical), None))


def ways(shape, rules: Iterable, logical: str) -> int:
  """Over how many devices a mesh of axis sizes `shape` (a mapping: name -> size, such as
  `Mesh.shape`) splits the logical axis `logical` under `rules`."""
  return math.prod(shape.get(a, 1) for a in rule_axes(rules, logical))


def target_axes(target) -> tuple:
  """A rule's target or a PartitionSpec entry (None, one mesh axis, or several) as a tuple."""
  return () if target is None else ((target,) if isinstance(target, str) else tuple(target))


def _rule_target(axes: tuple):
  """A tuple of mesh axes as a rule's target: None, one name, or the tuple."""
  return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def context_parallel_rules(rules: Iterable, axes) -> Rules:
  """`rules` with each row's tokens split over the mesh `axes` (context parallelism): the
  `activation_length` rule maps to them and the `batch` rule no longer uses them.

  A long trajectory then costs each device its share of the row's activations instead of the
  whole row (GSPMD inserts the collectives). Rows are spread over the batch rule's remaining
  axes.

  The Gated DeltaNet's recurrence runs along the row, chunk after chunk, so a row split by
  position would pass its state from device to device at every chunk (GSPMD gathers the whole
  sequence at each step of the chunk scan instead). Its per-head tensors are split by head over
  the same `axes` instead (`activation_heads`; all-to-alls in and out of the recurrence, as in
  DeepSpeed-Ulysses): each device runs whole rows of its heads. So does attention where the
  axes split its query heads evenly (its causal mask then skips work as on one device; else it
  gathers the keys and values). The LM head's logits are split
  by vocabulary over them too (`activation_vocab`): each device takes a block of positions
  whole and its share of the vocabulary."""
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  batch = tuple(a for a in rule_axes(rules, "batch") if a not in axes)
  split = lambda name: _rule_target(axes + tuple(a for a in rule_axes(rules, name)
                                                 if a not in axes))
  return with_targets(rules, batch=_rule_target(batch), activation_length=_rule_target(axes),
                       activation_heads=split("activation_heads"),
                       activation_vocab=split("activation_vocab"))


def without_context_parallel(rules: Iterable) -> Rules:
  """`rules` with whole rows again: the `activation_length` axes go back to the `batch` rule
  (and leave `activation_heads`). The rollout engine's layout: its decode state is split by
  slot over the batch axes, and a cache split by position would cost a collective at every
  decoded token."""
  length = rule_axes(rules, "activation_length")
  if not length:
    return rules_from_config(rules)
  batch = rule_axes(rules, "batch")
  batch += tuple(a for a in length if a not in batch)
  rest = lambda name: _rule_target(tuple(a for a in rule_axes(rules, name) if a not in length))
  return with_targets(rules, batch=_rule_target(batch), activation_length=None,
                       activation_heads=rest("activation_heads"),
                       activation_vocab=rest("activation_vocab"))


def with_targets(rules: Iterable, **targets) -> Rules:
  """`rules` with the targets of the logical axes named in `targets` replaced; a list gives
  one target per rule of that name, in order (a rule and its fallbacks), e.g.
  with_targets(rules, embed=[("data", "fsdp", "expert"), ("data", "fsdp")])."""
  out, seen = [], {}
  for name, target in rules_from_config(rules):
    if name in targets:
      new = targets[name]
      if isinstance(new, list):
        i = seen[name] = seen.get(name, -1) + 1
        new = new[min(i, len(new) - 1)]
      target = new
    out.append((name, target))
  return rules_from_config(out)


def _axis_size(mesh: Mesh, target) -> int:
  return math.prod(mesh.shape[n] for n in target_axes(target))


def logical_to_spec(logical_axes: Sequence[Optional[str]], rules: Rules,
                    mesh: Optional[Mesh] = None,
                    shape: Optional[Sequence[int]] = None) -> PartitionSpec:
  """Logical axis names -> PartitionSpec (each mesh axis used at most once per array).

  With `mesh` and `shape`, a dimension that the assigned mesh axes do not divide falls back
  to fewer axes (trailing ones dropped first) and finally to replication: e.g. 2 KV heads on
  a 4-way tensor axis stay replicated rather than failing.
  """
  spec = list(nn.logical_to_mesh_axes(tuple(logical_axes), rules))
  if mesh is not None and shape is not None:
    for i, target in enumerate(spec):
      if target is None:
        continue
      names = list(target_axes(target))
      names = [n for n in names if mesh.shape[n] > 1] or names[:0]
      while names and shape[i] % _axis_size(mesh, tuple(names)):
        names.pop()
      spec[i] = None if not names else (names[0] if len(names) == 1 else tuple(names))
  return PartitionSpec(*spec)


def is_axes_leaf(x) -> bool:
  """A leaf of a logical-axes tree: a tuple of axis names (or None)."""
  return isinstance(x, tuple) and all(isinstance(e, str) or e is None for e in x)


def tree_shardings(axes_tree: Any, shapes_tree: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings for a pytree, from its logical axes and shapes (ShapeDtypeStructs)."""
  def one(axes, sds):
    return NamedSharding(mesh, logical_to_spec(axes, rules, mesh, sds.shape))
  return jax.tree.map(one, axes_tree, shapes_tree, is_leaf=is_axes_leaf)


def with_shardings(shapes_tree: Any, shardings_tree: Any = None) -> Any:
  """ShapeDtypeStructs of `shapes_tree` carrying `shardings_tree` (None = all on this process's
  first device): an abstract tree to restore or compile against, allocating nothing."""
  if shardings_tree is None:
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings_tree = jax.tree.map(lambda _: one, shapes_tree)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes_tree, shardings_tree)


def shape_dtype_mismatches(got_tree: Any, want_tree: Any, cast_floats: bool = False) -> list[str]:
  """"path: (shape, dtype) != (shape, dtype)" for each leaf of two trees of arrays (or their
  metadata) that differs in shape or dtype, or is in one tree only ("missing").
  `cast_floats`: two floating dtypes count as the same (the receiver casts, e.g. float32 master
  weights into a bfloat16 engine)."""
  def kind(dtype):
    return "float" if cast_floats and jax.numpy.issubdtype(dtype, jax.numpy.floating) else str(dtype)
  flat = lambda t: {jax.tree_util.keystr(p): (tuple(x.shape), kind(x.dtype))
                    for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
  got, want = flat(got_tree), flat(want_tree)
  return [f"{k}: {got.get(k, 'missing')} != {want.get(k, 'missing')}"
          for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)]


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int, batch_size: Optional[int] = None) -> NamedSharding:
  """Sharding of a [batch, ...] array: batch over the mesh axes of the `batch` rule."""
  shape = None if batch_size is None else (batch_size,) + (1,) * (ndim - 1)
  logical = ("batch",) + (None,) * (ndim - 1)
  return NamedSharding(mesh, logical_to_spec(logical, rules, mesh, shape))


def shard_batch(batch: dict, mesh: Mesh, rules: Rules) -> dict:
  """Host numpy batch -> global jax arrays sharded over the batch axes.

  Single process: `batch` holds the global batch. Several processes: each holds its own
  contiguous slice of rows (process i holds rows [i*b, (i+1)*b)), as the data loader gives.
  """
  out = {}
  for k, v in batch.items():
    v = np.asarray(v)
    global_b = v.shape[0] * jax.process_count()
    sharding = batch_sharding(mesh, rules, v.ndim, global_b)
    if jax.process_count() == 1:
      out[k] = jax.device_put(v, sharding)
    else:
      out[k] = jax.make_array_from_process_local_data(sharding, v, (global_b,) + v.shape[1:])
  return out


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules):
  """Installs the mesh and the logical rules, so the model's activation hints take effect."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def describe(mesh: Mesh) -> str:
  return " x ".join(f"{n}={s}" for n, s in mesh.shape.items())
