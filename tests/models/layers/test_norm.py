"""RMSNorm's hand-written gradient: autodiff's values, without float32 copies of its input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from models.layers import norm


def _plain_rms_norm(x, weight, eps):
  """The formula as autodiff would see it (the reference for the custom VJP)."""
  out = norm._normalise(x.astype(jnp.float32), eps) * (1.0 + weight.astype(jnp.float32))
  return out.astype(x.dtype)


@pytest.mark.parametrize("x_dtype,w_dtype", [("float32", "float32"), ("bfloat16", "float32"),
                                             ("bfloat16", "bfloat16")])
def test_rms_norm_has_the_values_and_gradients_of_autodiff(x_dtype, w_dtype):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 5, 3, 32)) * 3, x_dtype)
  w = jnp.asarray(rng.standard_normal(32) * 0.5, w_dtype)
  cot = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

  def loss(f):
    return lambda x, w: jnp.sum(f(x, w, 1e-6).astype(jnp.float32) * cot)

  np.testing.assert_array_equal(norm.rms_norm(x, w, 1e-6), _plain_rms_norm(x, w, 1e-6))
  got = jax.jit(jax.grad(loss(norm.rms_norm), argnums=(0, 1)))(x, w)
  want = jax.jit(jax.grad(loss(_plain_rms_norm), argnums=(0, 1)))(x, w)
  # bfloat16 gradients are rounded once at the end either way; the float32 sums differ in order.
  tol = 1e-5 if x_dtype == "float32" else 1e-2
  for g, g_ref, name in zip(got, want, ("x", "weight")):
    assert g.dtype == g_ref.dtype, name
    scale = float(jnp.abs(g_ref.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32),
                               atol=tol * scale, err_msg=name)


def test_rms_norm_gradient_keeps_no_float32_copy_of_a_bfloat16_input():
  x = jax.ShapeDtypeStruct((4, 64, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256,), jnp.float32)

  def kept(f):
    res = saved_residuals(lambda x, w: f(x, w, 1e-6).astype(jnp.float32).sum(), x, w)
    return [a for a, _ in res if a.shape == x.shape and a.dtype == jnp.float32]

  assert len(kept(_plain_rms_norm)) >= 2      # what autodiff keeps
  assert kept(norm.rms_norm) == []
