"""common.recompute: the function's values and gradients, its inputs the only residuals, and the
recomputation in the backward pass where the compiler cannot move it forward."""
import jax
import jax.numpy as jnp
import numpy as np
from jax._src.ad_checkpoint import saved_residuals

from models.layers import common


def _layer(w1, w2, x, lengths=None, nothing=None):
  del nothing
  h = jnp.tanh(x @ w1)
  out = x + jnp.tanh(h @ w2)
  if lengths is not None:
    out = jnp.where(jnp.arange(x.shape[0])[:, None] < lengths, out, x)
  return out, jnp.sum(h, axis=0)


def test_recompute_gives_the_values_and_gradients_of_the_function():
  rng = np.random.default_rng(0)
  w1 = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
  lengths = jnp.int32(11)

  def loss(f):
    def run(w1, w2, x):
      out, side = f(w1, w2, x, lengths, None)
      return jnp.sum(jnp.sin(out)) + jnp.sum(side ** 2)
    return jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2)))

  value, grads = loss(common.recompute(_layer))(w1, w2, x)
  want_value, want_grads = loss(_layer)(w1, w2, x)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  for g, g_ref in zip(grads, want_grads):
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)


def test_recompute_keeps_only_the_inputs():
  w1 = jax.ShapeDtypeStruct((8, 32), jnp.float32)
  w2 = jax.ShapeDtypeStruct((32, 8), jnp.float32)
  x = jax.ShapeDtypeStruct((64, 8), jnp.float32)
  loss = lambda f: lambda w1, w2, x: jnp.sum(f(w1, w2, x)[0])
  assert any(a.shape == (64, 32) for a, _ in saved_residuals(loss(_layer), w1, w2, x))
  res = saved_residuals(loss(common.recompute(_layer)), w1, w2, x)
  assert all(a.shape in ((8, 32), (32, 8), (64, 8)) for a, _ in res), res


def test_recompute_holds_one_layer_of_intermediates_at_a_time_on_xla_cpu():
  """A chain of 4 layers, each with a [4096, 1024] float32 intermediate: under jax.checkpoint
  XLA:CPU runs every rematerialised forward right after the original one, so the program holds
  as much as without remat; under common.recompute it holds one layer's at a time."""
  def temp_mib(wrap):
    def loss(ws, x):
      for w1, w2 in ws:
        x = wrap(lambda w1, w2, x: _layer(w1, w2, x)[0])(w1, w2, x)
      return jnp.sum(x * x)
    ws = [(jax.ShapeDtypeStruct((64, 1024), jnp.float32),
           jax.ShapeDtypeStruct((1024, 64), jnp.float32))] * 4
    x = jax.ShapeDtypeStruct((4096, 64), jnp.float32)
    compiled = jax.jit(jax.grad(loss)).lower(ws, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2 ** 20

  plain = temp_mib(lambda f: f)
  assert temp_mib(common.recompute) < 0.6 * plain


def test_after_returns_its_input_unchanged_whatever_it_waits_for():
  x = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.int32(7)}
  for dep in (jnp.float32(jnp.nan), jnp.float32(jnp.inf), jnp.float32(-jnp.inf),
              (jnp.zeros((4,), jnp.bfloat16),)):
    got = jax.jit(common.after)(x, dep)
    assert jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), got, x) == {"a": True, "b": True}
