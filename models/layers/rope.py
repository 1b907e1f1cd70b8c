"""Partial rotary position embedding.

Qwen3.5 rotates only the first `rotary_dim` (head_dim * 0.25 = 64) channels of each head. Its
multimodal mRoPE gives the temporal, height and width sections the same position for text,
so for text-only input it is exactly the plain 1-D RoPE implemented here.
"""
import jax
import jax.numpy as jnp


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, dtype):
  """cos/sin tables for positions [batch, seq] -> two [batch, seq, rotary_dim] arrays."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _rotate_half(x: jax.Array) -> jax.Array:
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotates the leading channels of x [batch, seq, heads, head_dim]; cos/sin [batch, seq, rot]."""
  rot = cos.shape[-1]
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  x_rot, x_pass = x[..., :rot], x[..., rot:]
  x_rot = x_rot * cos + _rotate_half(x_rot) * sin
  return jnp.concatenate([x_rot, x_pass], axis=-1)
