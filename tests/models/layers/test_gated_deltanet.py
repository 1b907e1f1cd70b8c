"""The two forms of the gated delta rule agree, and the chunked one is accurate in float32."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from configs import base
from models import qwen3_5
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
  out_r, s_r = gated_deltanet.recurrent_delta_rule(q, k, v, g, beta, jnp.swapaxes(s0, 2, 3))
  np.testing.assert_allclose(out_c, out_r, atol=2e-5)
  np.testing.assert_allclose(s_c, jnp.swapaxes(s_r, 2, 3), atol=2e-5)   # S, and S transposed


def _decay_grad(dtype, scan="outputs", dv=8):
  q, k, v, a, a_log, beta, s0 = _inputs(dtype, dv=dv)
  w = jnp.asarray(np.random.default_rng(9).standard_normal(v.shape), dtype)

  def loss(a_log):
    g = -jnp.exp(a_log) * jax.nn.softplus(a)
    out, _ = gated_deltanet.chunked_delta_rule(q, k, v, g, beta, s0, 64, "custom", "highest",
                                               scan)
    return jnp.sum(out * w)

  return np.asarray(jax.grad(loss)(a_log), np.float64)


def test_chunked_decay_gradient_is_float32_accurate():
  """Strong decays (A up to 16) must not cost the A_log gradient its precision in float32."""
  g32 = _decay_grad(jnp.float32)
  with jax.enable_x64(True):
    g64 = _decay_grad(jnp.float64)
  assert np.abs(g32 - g64).max() <= 1e-5 * np.abs(g64).max()


@pytest.mark.parametrize("precision", ["high", "default"])
def test_gdn_precision_reaches_every_chunked_matmul_and_the_cpu_result_is_unchanged(precision):
  """model.gdn_precision is what the chunked rule's dots (forward and backward) ask XLA for;
  the CPU computes float32 dots whatever they ask, so its values stay those of `highest`."""
  q, k, v, a, a_log, beta, s0 = _inputs(jnp.float32)
  g = -jnp.exp(a_log) * jax.nn.softplus(a)

  def value_and_grad(prec):
    def loss(args):
      out, state = gated_deltanet.chunked_delta_rule(*args, 32, "custom", prec)
      return jnp.sum(out * out) + jnp.sum(state)
    return jax.value_and_grad(loss)

  args = ((q, k, v, g, beta, s0),)
  hlo = jax.jit(value_and_grad(precision)).lower(*args).as_text()
  assert "HIGHEST" not in hlo and ("HIGH" in hlo) == (precision == "high")
  assert "HIGHEST" in jax.jit(value_and_grad("highest")).lower(*args).as_text()
  got, want = value_and_grad(precision)(*args), value_and_grad("highest")(*args)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(x, y)


def _rule_grads(seed: int, *rule_args):
  """(gradients of every input, (outputs, final state)) of a weighted sum of the chunked
  rule's outputs and final state, the rule taking `rule_args` after its chunk of 64."""
  q, k, v, a, a_log, beta, s0 = _inputs(jnp.float32)
  g = -jnp.exp(a_log) * jax.nn.softplus(a)
  rng = np.random.default_rng(seed)
  w_out = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
  w_state = jnp.asarray(rng.standard_normal(s0.shape), jnp.float32)

  def loss(args):
    out, state = gated_deltanet.chunked_delta_rule(*args, 64, *rule_args)
    return jnp.sum(out * w_out) + jnp.sum(state * w_state), (out, state)
  return jax.jit(jax.grad(loss, has_aux=True))((q, k, v, g, beta, s0))


def _assert_rules_agree(got, want, grad_tol: float):
  (grads_x, (out_x, state_x)), (grads_y, (out_y, state_y)) = got, want
  np.testing.assert_allclose(out_x, out_y, atol=1e-6)
  np.testing.assert_allclose(state_x, state_y, atol=1e-6)
  for name, gx, gy in zip(("q", "k", "v", "g", "beta", "state"), grads_x, grads_y):
    scale = float(jnp.abs(gy).max())
    assert scale > 0, name
    np.testing.assert_allclose(gx, gy, atol=grad_tol * scale, err_msg=name)


def test_custom_and_autodiff_backward_give_the_same_outputs_and_gradients():
  """The hand-written VJP of the intra-chunk solve matches autodiff through the matmul loop:
  outputs, final state and the gradients of every input, the initial state included."""
  _assert_rules_agree(_rule_grads(3, "custom"), _rule_grads(3, "autodiff"), 2e-5)


@pytest.mark.parametrize("backward", ["custom", "autodiff"])
def test_the_states_scan_gives_the_outputs_scan_values_and_gradients(backward):
  """model.gdn_scan="states" (the scan carries only the state's recurrence, the outputs come
  after it for every chunk at once) equals the default "outputs" scan: outputs, final state
  and every input's gradient, over a length that pads the last chunk (150 in chunks of 64)."""
  _assert_rules_agree(_rule_grads(4, backward, "highest", "states"),
                      _rule_grads(4, backward, "highest", "outputs"), 1e-5)
  q, k, v, a, a_log, beta, s0 = _inputs(jnp.float32, seq=8)
  with pytest.raises(ValueError, match="gdn_scan"):
    gated_deltanet.chunked_delta_rule(q, k, v, a, beta, s0, 4, backward, "highest", "both")
  with pytest.raises(ValueError, match="gdn_scan"):
    qwen3_5.config_from_dict(base.get_model_config()).replace(gdn_scan="both")


def test_unknown_backward_is_a_clear_error():
  q, k, v, a, a_log, beta, s0 = _inputs(jnp.float32, seq=8)
  with pytest.raises(ValueError, match="gdn_backward"):
    gated_deltanet.chunked_delta_rule(q, k, v, a, beta, s0, 4, "symbolic")


@pytest.mark.parametrize("c", [8, 24, 33, 64])
def test_unit_lower_inverse_by_halves_matches_float64(c):
  """The chunk's (I + L)^-1, by halves down to 16 x 16 blocks (any size, odd ones included),
  equals numpy's float64 inverse within float32 rounding."""
  k = jax.random.normal(jax.random.key(c), (3, c, 16))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  lower = jnp.tril(jnp.einsum("bid,bjd->bij", k, k), -1)
  want = np.linalg.inv(np.eye(c) + np.asarray(lower, np.float64))
  got = np.asarray(gated_deltanet._unit_lower_inverse(lower))
  np.testing.assert_allclose(got, want, atol=2e-6 * np.abs(want).max())
  assert np.all(np.triu(got, 1) == 0)


def test_auto_chunk_is_32_on_cpu_and_64_elsewhere():
  cfg = qwen3_5.config_from_dict(base.get_model_config())
  assert cfg.gdn_chunk_size == -1
  assert gated_deltanet.chunk_size(cfg, backend="cpu") == 32
  assert gated_deltanet.chunk_size(cfg, backend="gpu") == 64
  assert gated_deltanet.chunk_size(cfg.replace(gdn_chunk_size=16), backend="cpu") == 16
  with pytest.raises(ValueError, match="gdn_chunk_size"):
    cfg.replace(gdn_chunk_size=0)


def _layer_inputs(seq=45, batch=2):
  m = base.get_model_config()
  cfg = qwen3_5.config_from_dict(m).replace(gdn_chunk_size=16)
  p = gated_deltanet.init(jax.random.key(1), cfg)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((batch, seq, cfg.hidden_size)), jnp.float32)
  state = {"conv": jnp.asarray(rng.standard_normal((batch, cfg.linear_conv_kernel_dim - 1,
                                                    cfg.gdn_conv_dim)), jnp.float32),
           "ssm": jnp.asarray(rng.standard_normal((batch, cfg.linear_num_value_heads,
                                                   cfg.linear_value_head_dim,
                                                   cfg.linear_key_head_dim)) * 0.1, jnp.float32)}
  return cfg, p, x, state


@pytest.mark.parametrize("with_state", [False, True])
def test_recomputed_layer_has_the_outputs_and_gradients_of_the_plain_one(with_state):
  """`forward(recompute=True)` (the default: the mixer recomputed in the backward pass) gives
  the plain layer's output, states and the gradients of every param, the input and the state."""
  cfg, p, x, state = _layer_inputs()
  lengths = jnp.asarray([45, 30], jnp.int32) if with_state else None
  rng = np.random.default_rng(2)
  w_out = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  w_ssm = jnp.asarray(rng.standard_normal(state["ssm"].shape), jnp.float32)

  def run(recompute):
    def loss(p, x, state):
      out, new = gated_deltanet.forward(p, x, cfg, state if with_state else None, lengths,
                                        recompute=recompute)
      return jnp.sum(out * w_out) + jnp.sum(new["ssm"] * w_ssm) + jnp.sum(new["conv"]), (out, new)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(p, x, state)

  grads, outs = run(True)
  grads_ref, outs_ref = run(False)
  for a, b in zip(jax.tree.leaves(outs), jax.tree.leaves(outs_ref)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(jnp.abs(b).max())),
                               err_msg=jax.tree_util.keystr(path))


def test_recomputed_layer_keeps_no_float32_per_head_tensors():
  """The gradient keeps the bfloat16 projections and the mixer's output, not the delta rule's
  float32 q, k, v, UT-transform solutions or per-chunk states (~150 KiB a token on the ~1B
  benchmark model, docs/model.md); `model.gdn_recompute=False` keeps them."""
  cfg, p, x, _ = _layer_inputs(seq=64)
  cfg = cfg.replace(dtype="bfloat16")
  x = jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
  p = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p)

  def kept(recompute):
    layer_cfg = cfg.replace(gdn_recompute=recompute)
    res = saved_residuals(lambda p, x: jnp.sum(
        gated_deltanet.forward(p, x, layer_cfg)[0].astype(jnp.float32)), p, x)
    return [a for a, where in res if a.dtype == jnp.float32 and a.size >= 64 * 16
            and "argument" not in where]

  assert len(kept(False)) >= 5
  assert kept(True) == []


@pytest.mark.parametrize("shards", [1, 2])
def test_the_fused_input_projections_give_the_four_matrices_outputs_and_states(shards):
  """The serving layout (one `in_proj` matrix, laid out for `shards` devices) gives the layer's
  output and states of its four projections apart, in prefill and in a decode step, and
  `split_in_projections` gives the four matrices back bit for bit."""
  cfg, p, x, state = _layer_inputs()
  fused = gated_deltanet.fuse_in_projections(p, shards)
  assert set(gated_deltanet.IN_PROJECTIONS).isdisjoint(fused)
  assert fused["in_proj"].shape[:-1] == (cfg.hidden_size, shards)
  back = gated_deltanet.split_in_projections(fused, cfg)
  assert jax.tree.structure(back) == jax.tree.structure(p)
  for k in p:
    np.testing.assert_array_equal(back[k], p[k], err_msg=k)
  # Shard s's row holds shard s's columns of each matrix, in order qkv | z | b | a.
  s = shards - 1
  want = np.concatenate([np.split(np.asarray(p[k]), shards, axis=-1)[s]
                         for k in gated_deltanet.IN_PROJECTIONS], axis=-1)
  np.testing.assert_array_equal(fused["in_proj"][:, s], want)
  for rule, xs in (("chunked", x), ("recurrent", x[:, :1])):
    run = jax.jit(lambda p, x: gated_deltanet.forward(p, x, cfg, state, rule=rule))
    for a, b in zip(jax.tree.leaves(run(fused, xs)), jax.tree.leaves(run(p, xs))):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=rule)


def test_projections_that_a_shard_count_does_not_split_evenly_are_not_fused():
  cfg, _, _, _ = _layer_inputs()
  nv = cfg.linear_num_value_heads
  assert gated_deltanet.can_fuse_in_projections(cfg, 1)
  assert not gated_deltanet.can_fuse_in_projections(cfg, nv + 1)
