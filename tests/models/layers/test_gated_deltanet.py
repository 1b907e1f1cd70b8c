"""The two forms of the gated delta rule agree, and the chunked one is accurate in float32."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers import gated_deltanet


def _inputs(dtype, seq=150, heads=3, dk=16, dv=8, seed=0):
  rng = np.random.default_rng(seed)
  q = gated_deltanet._l2norm(jnp.asarray(rng.standard_normal((2, seq, heads, dk)), dtype)) * dk ** -0.5
  k = gated_deltanet._l2norm(jnp.asarray(rng.standard_normal((2, seq, heads, dk)), dtype))
  v = jnp.asarray(rng.standard_normal((2, seq, heads, dv)), dtype)
  a = jnp.asarray(rng.standard_normal((2, seq, heads)), dtype)
  a_log = jnp.asarray(np.log(rng.uniform(1, 16, (heads,))), dtype)
  beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((2, seq, heads)), dtype))
  s0 = jnp.asarray(rng.standard_normal((2, heads, dk, dv)) * 0.1, dtype)
  return q, k, v, a, a_log, beta, s0


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_and_recurrent_forms_agree(chunk):
  q, k, v, a, a_log, beta, s0 = _inputs(jnp.float32)
  g = -jnp.exp(a_log) * jax.nn.softplus(a)
  out_c, s_c = gated_deltanet.chunked_delta_rule(q, k, v, g, beta, s0, chunk)
  out_r, s_r = gated_deltanet.recurrent_delta_rule(q, k, v, g, beta, s0)
  np.testing.assert_allclose(out_c, out_r, atol=2e-5)
  np.testing.assert_allclose(s_c, s_r, atol=2e-5)


def _decay_grad(dtype):
  q, k, v, a, a_log, beta, s0 = _inputs(dtype)
  w = jnp.asarray(np.random.default_rng(9).standard_normal(v.shape), dtype)

  def loss(a_log):
    g = -jnp.exp(a_log) * jax.nn.softplus(a)
    out, _ = gated_deltanet.chunked_delta_rule(q, k, v, g, beta, s0, 64)
    return jnp.sum(out * w)

  return np.asarray(jax.grad(loss)(a_log), np.float64)


def test_chunked_decay_gradient_is_float32_accurate():
  """Strong decays (A up to 16) must not cost the A_log gradient its precision in float32."""
  g32 = _decay_grad(jnp.float32)
  with jax.enable_x64(True):
    g64 = _decay_grad(jnp.float64)
  assert np.abs(g32 - g64).max() <= 1e-5 * np.abs(g64).max()
