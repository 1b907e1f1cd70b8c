"""RMSNorm variants of Qwen3.5. Both normalise in float32 and return the input dtype."""
import functools

import jax
import jax.numpy as jnp


def _normalise(x32: jax.Array, eps: float) -> jax.Array:
  return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """Zero-centred RMSNorm: `normalise(x) * (1 + w)`, weights initialised at 0.

  The scale is applied in float32 before the cast back, as the reference does, so bf16 runs
  round once rather than twice. The gradient is written by hand (`_rms_norm_bwd`): it keeps x
  itself and one float32 per row, where autodiff would keep three float32 copies of x's size
  (the upcast and the two products: 12 bytes an element against x's 2 in bfloat16, at every
  norm of every layer).

  Args:
    x: [..., dim] activations.
    weight: [dim] zero-centred scale.
  """
  return _rms_norm(x, weight, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, weight, eps):
  return _rms_norm_fwd(x, weight, eps)[0]


def _rms_norm_fwd(x, weight, eps):
  x32 = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  out = (x32 * inv) * (1.0 + weight.astype(jnp.float32))    # = _normalise(x32) * (1 + w)
  return out.astype(x.dtype), (x, weight, inv)


def _rms_norm_bwd(eps, residuals, g):
  """With n = x * inv: w_bar = sum of g n over the rows, and for gn = g (1 + w),
  x_bar = inv (gn - n mean(gn n)), all in float32."""
  del eps
  x, weight, inv = residuals
  n = x.astype(jnp.float32) * inv
  g32 = g.astype(jnp.float32)
  w_bar = jnp.sum(g32 * n, axis=tuple(range(x.ndim - 1))).astype(weight.dtype)
  gn = g32 * (1.0 + weight.astype(jnp.float32))
  x_bar = inv * (gn - n * jnp.mean(gn * n, axis=-1, keepdims=True))
  return x_bar.astype(x.dtype), w_bar


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """The Gated DeltaNet output norm: `w * normalise(x) * silu(gate)`, weights initialised at 1.

  Unlike `rms_norm` the weight is not zero-centred and the normalised value is cast back to
  the input dtype before the scale, matching the reference rounding.

  Args:
    x: [..., head_v_dim] per-head delta-rule output.
    gate: [..., head_v_dim] the `z` projection.
    weight: [head_v_dim].
  """
  normed = _normalise(x.astype(jnp.float32), eps).astype(x.dtype)
  out = weight.astype(x.dtype) * normed
  out = out.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
  return out.astype(x.dtype)
