"""`train.xla_cpu_dots`: its compiler options, and that Eigen's dots give the model's logits and
gradients of XLA's default (YNNPACK) within float32 rounding, with no dot left in YNNPACK."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from models import qwen3_5
from models import xla_flags

ON_CPU = pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU option")


def test_options_are_for_the_cpu_backend_alone():
  assert xla_flags.compiler_options("eigen", "cpu") == {
      "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}
  assert xla_flags.compiler_options("ynnpack", "cpu") == {}
  assert xla_flags.compiler_options("eigen", "gpu") == {}
  assert xla_flags.compiler_options("eigen", "tpu") == {}


def test_an_unknown_choice_is_an_error_naming_it():
  with pytest.raises(ValueError, match="xla_cpu_dots='mkl': expected one of eigen, ynnpack"):
    xla_flags.compiler_options("mkl", "cpu")


def test_the_default_config_choice_is_known():
  assert base.get_config().train.xla_cpu_dots in xla_flags.CPU_DOTS


@ON_CPU
def test_eigen_keeps_reductions_in_ynnpack_and_takes_the_dots_out():
  def f(a, b):
    return (jnp.sum(jnp.exp(a), axis=1), a @ b,
            jnp.einsum("bij,bjk->bik", a.reshape(4, 16, 64), b.reshape(4, 64, 16)))
  lowered = jax.jit(f).lower(jnp.ones((64, 64)), jnp.ones((64, 64)))
  default = lowered.compile().as_text()
  ynn = lowered.compile(compiler_options=xla_flags.compiler_options("ynnpack")).as_text()
  eigen = lowered.compile(compiler_options=xla_flags.compiler_options("eigen")).as_text()
  assert ynn == default and xla_flags.ynnpack_dots(ynn) == 2
  assert xla_flags.ynnpack_dots(eigen) == 0
  assert '"kind":"__ynn_fusion"' in eigen   # the reduction


def _loss(cfg, params, tokens):
  logits = qwen3_5.forward(cfg, params, tokens)
  logp = jax.nn.log_softmax(logits[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)), logits


@ON_CPU
def test_eigen_dots_give_ynnpacks_logits_and_gradients_within_float32_rounding():
  m = base.get_model_config()
  m.update(num_hidden_layers=4, num_experts_per_tok=2)
  cfg = qwen3_5.config_from_dict(m)
  params = qwen3_5.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 96), 0, cfg.vocab_size)
  step = jax.jit(jax.value_and_grad(lambda p, t: _loss(cfg, p, t), has_aux=True))
  lowered = step.lower(params, tokens)
  ynn = lowered.compile(compiler_options=xla_flags.compiler_options("ynnpack"))
  eigen = lowered.compile(compiler_options=xla_flags.compiler_options("eigen"))
  # The two programs differ where claimed: the model's dots in YNNPACK by default, none with eigen.
  assert xla_flags.ynnpack_dots(ynn.as_text()) > 0
  assert xla_flags.ynnpack_dots(eigen.as_text()) == 0
  (loss_y, logits_y), grads_y = ynn(params, tokens)
  (loss_e, logits_e), grads_e = eigen(params, tokens)
  np.testing.assert_allclose(logits_e, logits_y, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(loss_e, loss_y, rtol=1e-5)
  flat_y = dict(jax.tree_util.tree_leaves_with_path(grads_y))
  for path, g_e in jax.tree_util.tree_leaves_with_path(grads_e):
    g_y = flat_y[path]
    scale = float(jnp.max(jnp.abs(g_y))) + 1e-12   # relative to the leaf's largest entry
    np.testing.assert_allclose(g_e / scale, g_y / scale, atol=1e-4,
                               err_msg=jax.tree_util.keystr(path))
