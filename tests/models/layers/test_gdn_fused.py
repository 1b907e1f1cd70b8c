"""model.gdn_scan=fused: the chunked delta rule's walk over chunks and its chunks' outputs, each
one Pallas kernel a pass, give the values and gradients of the scan they replace, on one device
and on a mesh, and compile for an H200 to Triton kernels with no loop over the chunks left to
XLA."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from configs import base
from models import aot
from models import config as config_lib
from models import qwen3_5
from models import sharding
from models.layers import gated_deltanet
from models.layers import gdn_fused
from models.layers import norm

from tests.models import kernel_checks
from tests.models.layers.test_gated_deltanet import _assert_rules_agree, _decay_grad, _inputs

TRITON = "__gpu$xla.gpu.triton"


def _grads(scan: str, batch=2, seq=150, heads=3, dk=16, dv=64, chunk=16, seed=5,
           storage="float32"):
  """(gradients of q, k, v, g, beta and the initial state, (outputs, final state)) of a
  weighted sum of the chunked rule's outputs and final state under `scan`, jitted."""
  q, k, v, a, a_log, beta, s0 = _inputs(jnp.float32, seq=seq, heads=heads, dk=dk, dv=dv)
  q, k, v, a, beta, s0 = (jnp.concatenate([x] * (batch // 2)) for x in (q, k, v, a, beta, s0))
  g = -jnp.exp(a_log) * jax.nn.softplus(a)
  rng = np.random.default_rng(seed)
  w_out = jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
  w_state = jnp.asarray(rng.standard_normal(s0.shape), jnp.float32)

  def loss(args):
    out, state = gated_deltanet.chunked_delta_rule(*args, chunk, "custom", "highest", scan,
                                                   storage)
    return jnp.sum(out * w_out) + jnp.sum(state * w_state), (out, state)
  return jax.jit(jax.grad(loss, has_aux=True)), (q, k, v, g, beta, s0)


def test_the_fused_kernels_give_the_scans_values_and_gradients():
  """Outputs, final state and every input's gradient (the UT transform, walk and output
  kernels') equal the `states` scan's (XLA's solve, `lax.scan` and autodiff), over 10 chunks
  with the last one padded (150 in chunks of 16) and value heads of two walk programs'
  columns each (64 = 2 x BLOCK_V)."""
  assert 64 // gdn_fused.BLOCK_V == 2
  fused, args = _grads("fused")
  states, _ = _grads("states")
  _assert_rules_agree(fused(args), states(args), 1e-5)


def test_the_fused_outputs_over_two_blocks_of_state_columns_give_the_scans_gradients(
    monkeypatch):
  """The output kernel's forward programs each write OUTPUT_BLOCK_V of the state's columns and
  its backward program walks them a block at a time: with two blocks (value heads of 64 in
  blocks of 32) the values and every gradient are the `states` scan's."""
  monkeypatch.setattr(gdn_fused, "OUTPUT_BLOCK_V", 32)
  fused, args = _grads("fused")
  states, _ = _grads("states")
  _assert_rules_agree(fused(args), states(args), 1e-5)


def test_bfloat16_storage_rounds_what_the_kernels_store_and_nothing_more():
  """gdn_storage_dtype=bfloat16: q, k, v and what the kernels store between them (u, w, the
  states, the corrected values, the outputs, their gradients) in bfloat16, each computed in
  float32: outputs, final state and every input's gradient within 2% (of each one's largest)
  of float32 storage, a few bfloat16 roundings (2^-8 each), and off it by more than float32's
  own agreement (1e-5): the storage is in effect."""
  fused, args = _grads("fused")
  rounded, _ = _grads("fused", storage="bfloat16")
  (grads_x, (out_x, state_x)), (grads_y, (out_y, state_y)) = rounded(args), fused(args)
  assert out_x.dtype == jnp.bfloat16     # as the layer casts it next (`_mix`)
  for name, x, y in zip(("out", "state", "q", "k", "v", "g", "beta", "state0"),
                        (out_x, state_x) + tuple(grads_x), (out_y, state_y) + tuple(grads_y)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    scale = float(np.abs(y).max())
    assert np.abs(x - y).max() <= 2e-2 * scale, name
    assert np.abs(x - y).max() > 1e-5 * scale, name


def test_bfloat16_storage_without_the_fused_scan_is_refused_naming_both_keys():
  m = base.get_model_config()
  m.update(gdn_scan="states", gdn_storage_dtype="bfloat16")
  with pytest.raises(ValueError, match="gdn_storage_dtype='bfloat16' is for gdn_scan='fused'"):
    qwen3_5.config_from_dict(m)


def test_the_fused_kernels_keep_the_decay_gradient_float32_accurate():
  """The kernels sum each segment's log decays itself (a running sum down the columns), not
  as a difference of running sums: with decays up to A = 16 the A_log gradient stays within
  1e-5 of float64 (the scan's own form in float64), as the scan's does."""
  fused = _decay_grad(jnp.float32, "fused", dv=32)
  with jax.enable_x64(True):
    exact = _decay_grad(jnp.float64, "outputs", dv=32)
  assert np.abs(fused - exact).max() <= 1e-5 * np.abs(exact).max()


def test_the_fused_kernels_on_a_mesh_equal_one_device():
  """On 8 CPU devices, rows split 4 ways and heads 2 ways (`jax.shard_map`: XLA does not
  partition a Pallas kernel), the values and gradients are one device's."""
  grad, args = _grads("fused", batch=4, heads=4, seq=70)
  one = grad(args)
  mesh, rules, place = kernel_checks.mesh_2x2x1x2()
  with sharding.use_mesh(mesh, rules):
    placed = tuple(place(x, ("batch", None, "activation_heads") if x.ndim > 2 else ("batch",))
                   for x in args[:5]) + (args[5],)
    on_mesh = grad(placed)
  _assert_rules_agree(on_mesh, one, 1e-5)


def test_fused_on_tpu_is_an_error_that_names_the_setting():
  q, k, v, a, a_log, beta, s0 = _inputs(jnp.float32, seq=32)
  with config_lib.compiling_for("tpu"), pytest.raises(ValueError, match="gdn_scan=fused"):
    gated_deltanet.chunked_delta_rule(q, k, v, a, beta, s0, 16, "custom", "highest", "fused")


def test_the_model_runs_with_the_fused_kernels_as_with_the_scan():
  """The whole model's loss and gradients with gdn_scan=fused are the default scan's."""
  m = base.get_model_config()
  cfg = qwen3_5.config_from_dict(m)
  params = qwen3_5.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, cfg.vocab_size)

  def loss_and_grad(c):
    loss = lambda p: jnp.mean(qwen3_5.forward(c, p, tokens).astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)
  (lf, gf), (ls, gs) = loss_and_grad(cfg.replace(gdn_scan="fused")), loss_and_grad(cfg)
  np.testing.assert_allclose(lf, ls, rtol=1e-5)
  for x, y in zip(jax.tree.leaves(gf), jax.tree.leaves(gs)):
    np.testing.assert_allclose(x, y, atol=1e-5 * float(jnp.abs(y).max()) + 1e-8)


# One GPU is slow (`make test-all`, CI; ~45 s of compile): two GPUs, the same kernels per device
# with the rows split, stay in the quick suite.
@pytest.mark.parametrize("devices", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_the_fused_kernels_compile_for_an_h200_to_triton_kernels(devices):
  """Compiled for H200s from this CPU (XLA:GPU's Triton pipeline), the forward and backward
  walks and outputs are Triton kernels and no loop is left in the program (the scan's were
  33 chunk steps: here 33 chunks of 64, a count that is not a power of two); on two GPUs,
  rows split, the same per device."""
  targets = aot.target_devices(f"h200:1x{devices}")
  b, t, h, d = 2, 33 * 64, 4, 128
  mesh_cfg = base.get_config().mesh
  mesh_cfg.shape = (devices, 1, 1, 1)
  mesh = sharding.make_mesh(mesh_cfg, targets)
  rules = sharding.rules_from_config(mesh_cfg.rules)
  with config_lib.compiling_for("gpu"), sharding.use_mesh(mesh, rules):
    row = NamedSharding(mesh, sharding.logical_to_spec(("batch",), rules, mesh, (b,)))
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=row)
    args = (shape(b, t, h, d), shape(b, t, h, d), shape(b, t, h, d), shape(b, t, h),
            shape(b, t, h), shape(b, h, d, d))

    def loss(q, k, v, g, beta, s0):
      out, state = gated_deltanet.chunked_delta_rule(q, k, v, g, beta, s0, 64, "custom",
                                                     "highest", "fused")
      return jnp.sum(out) + jnp.sum(state)
    step = jax.value_and_grad(loss, argnums=tuple(range(6)))
    hlo = jax.jit(step).lower(*args).compile().as_text()
  assert hlo.count(f'custom_call_target="{TRITON}"') == 6, "solves, walks, outputs: both ways"
  assert " while(" not in hlo


def test_shapes_triton_cannot_tile_are_a_clear_error_on_gpu():
  """Traced for a GPU, a chunk or head width that is not a power of two >= 16 is named."""
  q, k, v, a, a_log, beta, s0 = _inputs(jnp.float32, seq=48, dk=24, dv=32)
  with config_lib.compiling_for("gpu"), pytest.raises(ValueError, match="linear_key_head_dim"):
    gated_deltanet.chunked_delta_rule(q, k, v, a, beta, s0, 16, "custom", "highest", "fused")
  q, k, v, a, a_log, beta, s0 = _inputs(jnp.float32, seq=48, dk=16, dv=32)
  with config_lib.compiling_for("gpu"), pytest.raises(ValueError, match="gdn_chunk_size"):
    gated_deltanet.chunked_delta_rule(q, k, v, a, beta, s0, 8, "custom", "highest", "fused")


def _decode_inputs(layers=3, rows=4, key_heads=2, heads=4, dk=32, dv=64, seed=0,
                   dtype=jnp.bfloat16):
  """One token's mixer inputs after the conv: q, k [rows, key_heads, dk], v [rows, heads, dv],
  the gates' projections z, b, a as one [rows, heads, dv + 2] (in `dtype`), live [rows] (row 1
  not live), the layer's {"A_log", "dt_bias", "norm"} and a stacked state [layers, rows,
  heads, dv, dk] (S transposed, as the cache holds it)."""
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  cast = lambda x: x.astype(dtype)
  live = jnp.ones((rows,), jnp.float32).at[1].set(0.0)
  params = {"A_log": f(heads) * 0.5, "dt_bias": f(heads), "norm": 1.0 + 0.1 * f(dv)}
  return (cast(f(rows, key_heads, dk)), cast(f(rows, key_heads, dk)), cast(f(rows, heads, dv)),
          cast(f(rows, heads, dv + 2)), live, params, f(layers, rows, heads, dv, dk) * 0.1)


def _xla_decode(q, k, v, gates, live, params, state, eps=1e-6):
  """The same token through XLA's ops, as `gated_deltanet._mix` runs it with gdn_decode=xla:
  (out [rows, heads, dv] in v's dtype, the new state)."""
  dv = v.shape[-1]
  z, beta_in, a = gates[..., :dv], gates[..., dv], gates[..., dv + 1]
  group = v.shape[1] // q.shape[1]
  dk = q.shape[-1]
  f32 = lambda x: x.astype(jnp.float32)
  beta = jax.nn.sigmoid(f32(beta_in)) * live[:, None]
  g = -jnp.exp(params["A_log"]) * jax.nn.softplus(f32(a) + params["dt_bias"]) * live[:, None]
  q = jnp.repeat(gated_deltanet._l2norm(f32(q)), group, axis=1) * dk ** -0.5
  k = jnp.repeat(gated_deltanet._l2norm(f32(k)), group, axis=1)
  out, state = gated_deltanet.recurrent_delta_rule(
      q[:, None], k[:, None], f32(v)[:, None], g[:, None], beta[:, None], state)
  return norm.gated_rms_norm(out[:, 0].astype(v.dtype), z, params["norm"], eps), state


def test_the_fused_decode_step_gives_xlas_mixer_values():
  """`gdn_fused.recurrent_step` (model.gdn_decode=fused), the mixer after the conv in one
  kernel: each layer of a stacked state updated in place (the others untouched), and an
  unstacked one, with the values of XLA's ops (the norms, the gates, the delta rule's step, the
  gated output norm); a row that is not live keeps its state."""
  *inputs, states = _decode_inputs()
  step = jax.jit(gdn_fused.recurrent_step)
  for layer in (0, 2):
    want_out, want_s = _xla_decode(*inputs, states[layer])
    out, new = step(*inputs, states, jnp.int32(layer))
    assert out.dtype == jnp.bfloat16
    # One bfloat16 rounding apart at most (the output is rounded twice on the way, as XLA's).
    np.testing.assert_allclose(np.float32(out), np.float32(want_out),
                               atol=2 ** -7 * float(jnp.abs(want_out.astype(jnp.float32)).max()))
    np.testing.assert_allclose(new[layer], want_s, atol=1e-5 * float(jnp.abs(want_s).max()))
    np.testing.assert_array_equal(new[layer, 1], states[layer, 1])
    others = [i for i in range(3) if i != layer]
    np.testing.assert_array_equal(new[np.asarray(others)], states[np.asarray(others)])
  out, new = step(*inputs, states[1])
  want_out, want_s = _xla_decode(*inputs, states[1])
  np.testing.assert_allclose(np.float32(out), np.float32(want_out),
                             atol=2 ** -7 * float(jnp.abs(want_out.astype(jnp.float32)).max()))
  np.testing.assert_allclose(new, want_s, atol=1e-5 * float(jnp.abs(want_s).max()))


def test_the_fused_decode_steps_output_in_float32_is_xlas_to_float32_rounding():
  """In float32 (no bfloat16 rounding between the ops) the kernel's normed, gated output is
  XLA's mixer's to float32 accuracy: the bfloat16 test's tolerance is the roundings', not the
  kernel's."""
  *inputs, states = _decode_inputs(dtype=jnp.float32)
  want_out, want_s = _xla_decode(*inputs, states[2])
  out, new = jax.jit(gdn_fused.recurrent_step)(*inputs, states, jnp.int32(2))
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, want_out, atol=1e-5 * float(jnp.abs(want_out).max()))
  np.testing.assert_allclose(new[2], want_s, atol=1e-5 * float(jnp.abs(want_s).max()))


def test_the_fused_decode_step_on_a_mesh_equals_one_device():
  """On 8 CPU devices, rows split 2 ways and heads 2 ways (`jax.shard_map`; each device's value
  heads read its own key heads), the values and the updated stack are one device's."""
  *inputs, params, states = _decode_inputs(rows=4)
  one = jax.jit(gdn_fused.recurrent_step)(*inputs, params, states, jnp.int32(1))
  mesh, rules, place = kernel_checks.mesh_2x2x1x2()
  rows_heads = ("batch", "activation_heads", None)
  axes = (rows_heads,) * 4 + (("batch",),)
  with sharding.use_mesh(mesh, rules):
    placed = [place(x, a) for x, a in zip(inputs, axes)]
    placed_states = place(states, (None, "batch", "activation_heads", None, None))
    assert placed_states.sharding.shard_shape(states.shape)[1:3] != states.shape[1:3]
    on_mesh = jax.jit(gdn_fused.recurrent_step)(*placed, params, placed_states, jnp.int32(1))
  for a, b in zip(on_mesh, one):
    np.testing.assert_allclose(np.float32(a), np.float32(b), atol=1e-6)


def test_a_model_decodes_with_the_fused_state_update_as_with_xla():
  """Prefill then eight decode steps of the whole model (every layer's states stacked in the
  decode scan's carry, each updated in place): the same logits and states either way."""
  runs = kernel_checks.decode_each_way("gdn_decode", config_lib.GDN_DECODES)
  (logits, cache), (want_logits, want_cache) = runs["fused"], runs["xla"]
  for a, b in zip(logits, want_logits):
    np.testing.assert_allclose(a, b, atol=1e-4)
  for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(want_cache)):
    np.testing.assert_allclose(a, b, atol=1e-4)


def test_the_fused_decode_step_names_its_setting_on_tpu_and_shapes_triton_cannot_tile():
  *inputs, states = _decode_inputs(dk=24)
  with config_lib.compiling_for("tpu"), pytest.raises(ValueError, match="gdn_decode=fused"):
    gdn_fused.recurrent_step(*inputs, states, 0)
  with config_lib.compiling_for("gpu"), pytest.raises(ValueError, match="linear_key_head_dim"):
    gdn_fused.recurrent_step(*inputs, states, 0)
