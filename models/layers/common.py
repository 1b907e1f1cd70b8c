"""Small helpers shared by the layers: initialisers, dtype casts, activation sharding hints."""
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from models import config as config_lib
from models import sharding


def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
  """Hints the sharding of an activation by logical axis names.

  A no-op unless the caller has installed rules (`nn.logical_axis_rules`) and a mesh, so the
  model runs unchanged on one device, and inside a `shard_map` over every mesh axis (each
  device's own shard: nothing left to lay out).
  """
  if inside_shard_map():
    return x
  return nn.with_logical_constraint(x, logical_axes)


def inside_shard_map() -> bool:
  """Whether the code is traced inside a `shard_map` over every mesh axis: each device's own
  shard, nothing left to lay out or to split again."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


def triton_interpret(setting: str, on_tpu: str) -> bool:
  """Whether the Triton (Pallas) kernel that `setting` selects runs in Pallas' interpreter (on
  CPU: the tests) rather than compiled by XLA's Triton pipeline (GPU, also when compiling for a
  GPU target from a CPU). On TPU, which has no such kernel, an error naming the setting and
  `on_tpu`, what to use there instead."""
  platform = config_lib.platform()
  if platform == "tpu":
    raise ValueError(f"model.{setting} is a GPU (Triton) kernel; on TPU use {on_tpu}")
  return platform not in ("gpu", "cuda", "rocm")


def check_triton_dims(setting: str, dims) -> None:
  """Triton's blocks and dots take powers of two of at least 16 on every side: for each
  (name, size) of `dims`, an error naming `setting` and the first size that is not one."""
  for name, n in dims:
    if n < 16 or n & (n - 1):
      raise ValueError(f"model.{setting} on GPU needs {name} a power of two >= 16, got {n}")


def kernel_mesh():
  """(mesh, rules) a Pallas kernel must run under per device (`jax.shard_map`: XLA does not
  partition a Pallas kernel), or None where it runs as it is: no mesh, one device, or already
  inside a `shard_map` over every axis."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or inside_shard_map():
    return None
  return mesh, sharding.rules_from_config(nn.get_logical_axis_rules())


def per_device(local, args: tuple, in_axes: tuple, out_axes):
  """`local(*args)`, on a mesh once per device on its own shard (`jax.shard_map`: XLA does not
  partition a Pallas kernel), as it is where `kernel_mesh` says so.

  `in_axes` holds one tuple of logical axis names per arg (a prefix of its dims, None for a
  dim every device holds whole), `out_axes` the same for local's results (a tuple of them for
  several). A name is split over the same mesh axes in every operand, the axes its rule maps
  it to that divide every dim it names (so query heads follow their kv heads), else none.
  """
  on_mesh = kernel_mesh()
  if on_mesh is None:
    return local(*args)
  mesh, rules = on_mesh
  sizes = {}
  for axes, x in zip(in_axes, args):
    for name, n in zip(axes, x.shape):
      if name is not None:
        sizes[name] = math.gcd(sizes.get(name, 0), n)
  split = dict(zip(sizes, sharding.logical_to_spec(tuple(sizes), rules, mesh,
                                                   tuple(sizes.values()))))
  spec = lambda axes: jax.sharding.PartitionSpec(*(split[n] if n else None for n in axes))
  out_specs = jax.tree.map(spec, out_axes, is_leaf=sharding.is_axes_leaf)
  return jax.shard_map(local, mesh=mesh, in_specs=tuple(spec(a) for a in in_axes),
                       out_specs=out_specs, check_vma=False)(*args)


def token_groups(shape) -> tuple[tuple, int, int]:
  """How the tokens of an activation of `shape` [batch, seq, ...] are split under the current
  mesh and logical rules: (mesh axes, groups of rows, groups of each row's positions), the
  `batch` axes that divide the rows, then the `activation_length` axes that divide each row.
  ((), 1, 1) without a mesh or where nothing is split."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return (), 1, 1
  rules = sharding.rules_from_config(nn.get_logical_axis_rules())
  spec = sharding.logical_to_spec(("batch", "activation_length"), rules, mesh, shape[:2])
  size = lambda t: math.prod(mesh.shape[a] for a in sharding.target_axes(t))
  axes = tuple(a for t in spec for a in sharding.target_axes(t) if mesh.shape[a] > 1)
  return axes, size(spec[0]), size(spec[1])


def split_ways(logical: str) -> int:
  """Over how many devices the current mesh and logical rules split the logical axis
  `logical` (1 without a mesh, or inside a `shard_map` over every mesh axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or inside_shard_map():
    return 1
  rules = sharding.rules_from_config(nn.get_logical_axis_rules())
  return sharding.ways(mesh.shape, rules, logical)


def normal(key, shape, std, dtype):
  return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def dense(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """x @ w over the last axis of x and the first of w, computed in `dtype`."""
  return jnp.tensordot(x.astype(dtype), w.astype(dtype), axes=1)


def after(x, dep):
  """`x` (a pytree), computed no earlier than `dep` (a pytree with an array leaf): its values,
  with a dependency on `dep` that every compiler keeps.

  An optimization barrier joins the two, which XLA:GPU and XLA:TPU schedule by; XLA:CPU drops
  optimization barriers before it schedules, so there is a data dependency as well: a select
  on `dep`'s first element compared with +inf, False for every value, NaN included.
  """
  x, dep = jax.lax.optimization_barrier((x, dep))
  leaf = jax.tree.leaves(dep)[0]
  # Indexed, not raveled: flattening an array split over devices gathers it whole first.
  never = leaf[(0,) * leaf.ndim].astype(jnp.float32) > jnp.inf
  return jax.tree.map(lambda a: jnp.where(never, jnp.zeros_like(a), a), x)


def recompute(f):
  """`f` rematerialised: its gradient keeps only f's inputs, and the backward pass runs f again.

  Like `jax.checkpoint(f)`, with one difference that decides the memory: the recomputation
  waits for the cotangent of f's output (`after`), so the compiler cannot schedule it early.
  Under `jax.checkpoint` nothing ties the rematerialised forward to the backward pass, and
  XLA:CPU runs it right after the original forward: every layer's intermediates are then live
  together, exactly as without remat (the ~1B model's Gated DeltaNet layers kept 137 of 141
  KiB a token; benchmarks/activation_memory.py).
  Values and gradients are those of f. Not forward-differentiable (a custom VJP).
  """
  @jax.custom_vjp
  def wrapped(*args):
    return f(*args)

  def fwd(*args):
    return f(*args), args

  def bwd(args, cotangent):
    _, vjp = jax.vjp(f, *after(args, cotangent))
    return vjp(cotangent)

  wrapped.defvjp(fwd, bwd)
  return wrapped
