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
