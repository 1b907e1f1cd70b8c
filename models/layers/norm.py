"""RMSNorm variants of Qwen3.5. Both normalise in float32 and return the input dtype."""
import jax
import jax.numpy as jnp


def _normalise(x32: jax.Array, eps: float) -> jax.Array:
  return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """Zero-centred RMSNorm: `normalise(x) * (1 + w)`, weights initialised at 0.

  The scale is applied in float32 before the cast back, as the reference does, so bf16 runs
  round once rather than twice.

  Args:
    x: [..., dim] activations.
    weight: [dim] zero-centred scale.
  """
  out = _normalise(x.astype(jnp.float32), eps) * (1.0 + weight.astype(jnp.float32))
  return out.astype(x.dtype)


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
