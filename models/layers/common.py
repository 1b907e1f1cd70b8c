"""Small helpers shared by the layers: initialisers, dtype casts, activation sharding hints."""
import jax
import jax.numpy as jnp
from flax import linen as nn


def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
  """Hints the sharding of an activation by logical axis names.

  A no-op unless the caller has installed rules (`nn.logical_axis_rules`) and a mesh, so the
  model runs unchanged on one device.
  """
  return nn.with_logical_constraint(x, logical_axes)


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
  never = jnp.ravel(jax.tree.leaves(dep)[0])[0].astype(jnp.float32) > jnp.inf
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
