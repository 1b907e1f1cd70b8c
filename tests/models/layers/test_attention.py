"""The attention implementations (model.attention_impl) agree with the einsum reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from configs import base
from models import config as config_lib
from models import qwen3_5
from models import sharding
from models.layers import attention
from models.layers import flash_attention
from tests.models import kernel_checks


def _cfg(**kw):
  m = base.get_model_config()
  m.update(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
  m.update(kw)
  return qwen3_5.config_from_dict(m)


def _inputs(cfg, batch=2, seq=24, seed=0):
  params = attention.init(jax.random.key(seed), cfg)
  # The zero-centred q/k norms start at identity; random ones exercise their gradients too.
  rng = np.random.default_rng(seed)
  params["q_norm"] = jnp.asarray(rng.standard_normal(cfg.head_dim) * 0.3, jnp.float32)
  params["k_norm"] = jnp.asarray(rng.standard_normal(cfg.head_dim) * 0.3, jnp.float32)
  x = jnp.asarray(rng.standard_normal((batch, seq, cfg.hidden_size)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  return params, x, positions


def _value_and_grads(cfg, params, x, positions):
  w = jnp.asarray(np.random.default_rng(7).standard_normal(x.shape), jnp.float32)

  def loss(p, x):
    out, _ = attention.forward(p, x, positions, cfg)
    return jnp.sum(out * w), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return out, grads


@pytest.mark.parametrize("knobs", [{}, {"attention_query_chunk": 8},
                                   {"attention_causal_block": 8}])
def test_xla_attention_matches_reference_outputs_and_gradients(knobs):
  ref_cfg = _cfg(attention_impl="reference", **knobs)
  params, x, positions = _inputs(ref_cfg)
  out_ref, grads_ref = _value_and_grads(ref_cfg, params, x, positions)
  out, grads = _value_and_grads(ref_cfg.replace(attention_impl="xla"), params, x, positions)
  np.testing.assert_allclose(out, out_ref, atol=1e-5)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(g, g_ref, atol=2e-5 * float(jnp.abs(g_ref).max()))


@pytest.mark.parametrize("seq", [24, 136])
def test_pallas_flash_attention_matches_reference_outputs_and_gradients(seq):
  """`attention_impl=pallas` (JAX's Triton flash attention, in Pallas' interpreter here): the
  two kv heads repeated for their query heads, rows padded to whole blocks (24 to 32 in one
  block; 136 to 256, two query blocks of 128 and four key blocks of 64)."""
  ref_cfg = _cfg(attention_impl="reference")
  params, x, positions = _inputs(ref_cfg, seq=seq)
  out_ref, grads_ref = _value_and_grads(ref_cfg, params, x, positions)
  out, grads = _value_and_grads(ref_cfg.replace(attention_impl="pallas"), params, x, positions)
  np.testing.assert_allclose(out, out_ref, atol=1e-5)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(g, g_ref, atol=2e-5 * float(jnp.abs(g_ref).max()))


def test_pallas_flash_attention_on_a_mesh_equals_one_device():
  """On 8 CPU devices, rows split 4 ways and heads 2 ways (`jax.shard_map`: XLA does not
  partition a Pallas kernel; the kv heads repeated before the split), the outputs and the
  gradients of q, k and v are one device's."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
             for shape in ((4, 40, 4, 16), (4, 40, 2, 16), (4, 40, 2, 16)))
  w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  run = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(flash_attention.causal(*a) * w),
                                   argnums=(0, 1, 2)))
  one = run(q, k, v)
  mesh, rules, place = kernel_checks.mesh_2x2x1x2()
  with sharding.use_mesh(mesh, rules):
    heads = ("batch", None, "activation_heads", None)
    on_mesh = run(*(place(x, heads) for x in (q, k, v)))
  for got, want in zip(jax.tree.leaves(on_mesh), jax.tree.leaves(one)):
    np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()))


def test_pallas_attention_is_refused_on_tpu_naming_the_key():
  cfg = _cfg(attention_impl="pallas")
  params, x, positions = _inputs(cfg)
  with config_lib.compiling_for("tpu"), pytest.raises(
      ValueError, match="model.attention_impl=pallas is a GPU.*use xla"):
    attention.forward(params, x, positions, cfg)


def test_auto_causal_block_is_128_with_the_reference_einsums_and_eight_on_long_xla_rows():
  cfg = _cfg(attention_causal_block=-1)
  assert attention.causal_block(cfg.replace(attention_impl="reference")) == 128
  assert attention.causal_block(cfg.replace(attention_impl="auto"), backend="cpu") == 128
  assert attention.causal_block(cfg.replace(attention_impl="xla")) == 0
  assert attention.causal_block(cfg.replace(attention_impl="auto"), backend="tpu") == 0
  assert attention.causal_block(cfg.replace(attention_causal_block=64)) == 64
  # XLA's attention in query chunks: whole chunks in 8 blocks (160k in chunks of 2048: 80
  # chunks, 8 blocks of 10); rows of one chunk or without chunks: one block.
  chunked = cfg.replace(attention_impl="xla", attention_query_chunk=2048)
  assert attention.causal_block(chunked, t=163840) == 20480
  assert attention.causal_block(chunked, t=5000) == 2048
  assert attention.causal_block(chunked, t=2048) == 0
  assert attention.causal_block(cfg.replace(attention_impl="xla"), t=163840) == 0
  with pytest.raises(ValueError, match="attention_causal_block"):
    cfg.replace(attention_causal_block=-2)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_attention_prefill_then_decode_matches_the_whole_sequence(impl):
  cfg = _cfg(attention_impl=impl)
  params, x, positions = _inputs(cfg, seq=12)
  whole, _ = attention.forward(params, x, positions, cfg)
  cache = {"k": jnp.zeros((2, 16, 2, 16)), "v": jnp.zeros((2, 16, 2, 16))}
  _, cache = attention.forward(params, x[:, :8], positions[:, :8], cfg, cache=cache)
  for i in range(8, 12):
    out, cache = attention.decode(params, x[:, i:i + 1], positions[:, i], cache, cfg)
    np.testing.assert_allclose(out[:, 0], whole[:, i], atol=1e-5)
  ref, _ = attention.forward(params, x, positions, cfg.replace(attention_impl="reference"))
  np.testing.assert_allclose(whole, ref, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_the_models_logits_and_gradients_match_reference(impl):
  cfg = _cfg(attention_impl="reference")
  params = qwen3_5.init_params(cfg, jax.random.key(1))
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 20)), jnp.int32)

  def run(cfg):
    def loss(p):
      logits = qwen3_5.forward(cfg, p, tokens)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 1]), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (_, logits_ref), grads_ref = run(cfg)
  (_, logits), grads = run(cfg.replace(attention_impl=impl))
  np.testing.assert_allclose(logits, logits_ref, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads, grads_ref)


def test_cudnn_is_refused_off_gpu_naming_the_key():
  cfg = _cfg(attention_impl="cudnn", dtype="bfloat16")
  with pytest.raises(ValueError, match="model.attention_impl='cudnn'.*'cpu'"):
    attention.resolve_impl(cfg, backend="cpu")
  with pytest.raises(ValueError, match="model.attention_impl='cudnn'.*bfloat16"):
    attention.resolve_impl(cfg.replace(dtype="float32"), backend="gpu")


def test_auto_picks_per_backend():
  cfg = _cfg(attention_impl="auto")
  assert attention.resolve_impl(cfg, backend="cpu") == "reference"
  assert attention.resolve_impl(cfg, backend="tpu") == "xla"
  assert attention.resolve_impl(cfg, backend="gpu") == "xla"
  assert attention.resolve_impl(cfg.replace(dtype="bfloat16"), backend="gpu") == "cudnn"


def test_pallas_stands_in_for_cudnn_only_where_auto_would_pick_it():
  cfg = _cfg(attention_impl="auto", dtype="bfloat16")
  assert attention.stands_in_for_cudnn(cfg, "gpu")
  assert not attention.stands_in_for_cudnn(cfg.replace(dtype="float32"), "gpu")   # xla there
  assert not attention.stands_in_for_cudnn(cfg, "tpu")
  assert not attention.stands_in_for_cudnn(cfg.replace(attention_impl="xla"), "gpu")


@pytest.mark.parametrize("knobs", [{"attention_causal_block": 8}, {"attention_causal_block": 0},
                                   {"attention_causal_block": 8, "attention_impl": "xla"}])
def test_recomputed_scores_give_the_outputs_and_gradients_of_kept_ones(knobs, monkeypatch):
  """Each causal block's scores recomputed in the backward pass (the default) against the
  same attention with autodiff's kept scores: outputs and every gradient."""
  cfg = _cfg(attention_impl="reference", **knobs) if "attention_impl" not in knobs else _cfg(**knobs)
  params, x, positions = _inputs(cfg)
  out, grads = _value_and_grads(cfg, params, x, positions)
  kept = attention._attend_causal
  monkeypatch.setattr(attention, "_attend_causal",
                      lambda *a, **kw: kept(*a, **kw, recompute=False))
  out_ref, grads_ref = _value_and_grads(cfg, params, x, positions)
  np.testing.assert_allclose(out, out_ref, atol=1e-6)
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(g, g_ref, atol=1e-5 * float(jnp.abs(g_ref).max()))


def test_the_gradient_keeps_no_scores():
  """q, k, v and the output are kept for the backward pass, no [queries, keys] array."""
  cfg = _cfg(attention_impl="reference", attention_causal_block=16)
  params, x, positions = _inputs(cfg, seq=64)
  res = saved_residuals(lambda p, x: jnp.sum(attention.forward(p, x, positions, cfg)[0]),
                        params, x)
  assert not [a for a, _ in res if a.ndim >= 4 and a.shape[-1] >= 16 and a.shape[-2] == 16
              and a.shape[-1] != cfg.head_dim], res


def test_compiled_layer_holds_one_block_of_scores_at_a_time(monkeypatch):
  """On XLA:CPU, 16 causal blocks of a 1024-token row: the recomputed blocks run one after
  another, forward and backward, so the layer's temporaries hold one block's scores where
  kept scores hold all sixteen."""
  cfg = _cfg(attention_impl="reference", attention_causal_block=64)
  params, x, positions = _inputs(cfg, batch=1, seq=1024)
  args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))

  def temp_bytes():
    loss = lambda p, x: jnp.sum(jnp.square(attention.forward(p, x, positions, cfg)[0]))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  recomputed = temp_bytes()
  kept = attention._attend_causal
  monkeypatch.setattr(attention, "_attend_causal",
                      lambda *a, **kw: kept(*a, **kw, recompute=False))
  assert recomputed < 0.4 * temp_bytes()


def test_query_chunks_under_context_parallelism_stay_on_their_devices():
  """A row split by position over 4 devices (fsdp x expert of a 2x2x2 mesh), attended in query
  chunks: the same outputs and gradients as on one device, and the collectives do not grow
  with the loop's steps (each step takes chunk / 4 queries of every device's part; keys and
  values are gathered once for the loop, not at every step), also where a device's part is no
  multiple of its share of the chunk."""
  from models import aot
  mesh, rules = kernel_checks.split_rows_mesh((2, 2, 2, 1))
  collectives = {}
  # chunk 8: 2 queries of each part a step, 8 and 16 steps; chunk 32, 8 a part: parts of 20 in
  # 4 steps of 5, parts of 22 padded to 3 steps of 8.
  for chunk, seq in ((8, 64), (8, 128), (32, 80), (32, 88)):
    # 6 heads, which 4 devices do not split evenly: attention stays on the split positions.
    cfg = _cfg(attention_query_chunk=chunk, attention_impl="xla", attention_causal_block=0,
               num_attention_heads=6)
    params, x, positions = _inputs(cfg, batch=2, seq=seq)
    loss = lambda p, x: jnp.sum(attention.forward(p, x, positions, cfg)[0] ** 2)
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    ref, got, hlo = kernel_checks.one_device_and_split_rows(grad, params, x, mesh, rules)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
    collectives[seq] = sum(v["count"] for v in aot.hlo_costs(hlo)["collectives"].values())
  # 8 more steps at 128 than at 64: at most one collective more a step (XLA:CPU keeps one
  # all-reduce in the loop's backward). A loop over the row's chunks in order added 7 a step
  # here (61 and 117 collectives), gathering the queries, keys and values again each time.
  assert collectives[128] - collectives[64] <= 8, collectives


def test_under_context_parallelism_attention_goes_by_head_with_one_devices_causal_work():
  """Rows split by position over 8 devices (fsdp x expert of a 1x2x4x1 mesh, the 35B-A3B
  config's layout at half the size), 8 query heads and 2 key/value heads: the same outputs and
  gradients as on one device, the 8 devices' compiled FLOPs together those of one device (XLA's
  attention in causal blocks of query chunks), and q, k, v and the output moved by all-to-alls,
  nothing gathered whole. On the split positions (the code before, or heads that the devices
  do not split evenly) each device scored its queries against every key of the row: the
  square's FLOPs, 1.48x the causal blocks' here, 2x the attention's at 35B-A3B's 160k tokens."""
  from models import aot
  mesh, rules = kernel_checks.split_rows_mesh((1, 2, 4, 1))
  cfg = _cfg(num_attention_heads=8, attention_impl="xla", attention_query_chunk=16)
  params, x, positions = _inputs(cfg, batch=2, seq=256)
  loss = lambda p, x: jnp.sum(attention.forward(p, x, positions, cfg)[0] ** 2)
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  want, got, hlo = kernel_checks.one_device_and_split_rows(grad, params, x, mesh, rules)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=1e-5 * max(1.0, float(jnp.abs(w).max())))
  flops = lambda g, *args: aot.hlo_costs(g.lower(*args).compile().as_text())["flops"]
  split, one = aot.hlo_costs(hlo), flops(grad, params, x)
  square = cfg.replace(attention_causal_block=0)     # every query against every key
  whole = flops(jax.jit(jax.value_and_grad(
      lambda p, x: jnp.sum(attention.forward(p, x, positions, square)[0] ** 2))), params, x)
  assert split["flops"] * 8 <= 1.01 * one < 0.75 * whole, (split["flops"] * 8, one, whole)
  assert set(split["collectives"]) <= {"all-to-all", "all-reduce"}, split["collectives"]


def test_cudnn_takes_the_causal_square_whole_whatever_the_query_chunk(monkeypatch):
  """Under cuDNN (compiled for a GPU) a row's causal attention is one flash-attention call
  even with `attention_query_chunk` set: its memory is O(seq) already, and query chunks went to
  XLA's masked attention, which scores the whole square. A continuation after a cached prefix
  (offset > 0) still goes in chunks."""
  from models import config as config_lib
  cfg = _cfg(attention_impl="cudnn", dtype="bfloat16", attention_query_chunk=8)
  calls = []
  monkeypatch.setattr(attention, "_attend", lambda q, k, v, mask, cfg, causal=False: (
      calls.append((q.shape[1], k.shape[1], causal)) or jnp.zeros(q.shape, q.dtype)))
  q = jnp.zeros((1, 32, 4, 16), jnp.bfloat16)
  k = jnp.zeros((1, 32, 2, 16), jnp.bfloat16)
  with config_lib.compiling_for("gpu"):
    attention._attend_causal(q, k, k, cfg)
    assert calls == [(32, 32, True)]
    calls.clear()
    attention._attend_causal(q[:, :16], k, k, cfg, offset=16)
  assert calls and all(not causal and t <= 8 for t, _, causal in calls), calls


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("max_len,block", [(40, 8), (37, 8), (37, 64)])
def test_decode_over_cached_blocks_matches_masked_attention_over_the_whole_cache(
    dtype, atol, max_len, block):
  """The blockwise online softmax (a loop over the blocks the longest row needs, the last
  block shifted back when the capacity is not a multiple) equals softmax attention over the
  whole cache with the token written at pos and every position after it masked: rows with an
  empty cache, a block's worth, and one short of capacity."""
  rng = np.random.default_rng(3)
  b, nkv, g, hd = 4, 2, 3, 16
  rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  q, k_new, v_new = rand(b, nkv * g, hd), rand(b, nkv, hd), rand(b, nkv, hd)
  k_cache, v_cache = rand(b, max_len, nkv, hd), rand(b, max_len, nkv, hd)
  pos = jnp.asarray([0, min(block, max_len - 2), 17, max_len - 1], jnp.int32)
  new = {"k": k_new, "v": v_new}
  written = attention.write_decoded({"k": k_cache, "v": v_cache}, new, pos)
  out, _ = jax.jit(attention._attend_cached, static_argnums=5)(q, written, new, pos, None, block)
  mask = (jnp.arange(max_len)[None, :] <= pos[:, None])[:, None, :]
  ref = attention._attend(q[:, None], written["k"], written["v"], mask,
                          _cfg(attention_impl="reference"))[:, 0]
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=atol)


def test_decode_reads_only_the_blocks_that_hold_cached_tokens():
  """Positions past every row's pos are never read: filling them with NaN changes nothing
  (a full-capacity read would spread the NaN through the scores' max or the values' sum)."""
  rng = np.random.default_rng(4)
  b, nkv, hd, max_len, block = 2, 2, 16, 64, 8
  rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q, k_new, v_new = rand(b, 4, hd), rand(b, nkv, hd), rand(b, nkv, hd)
  k_cache, v_cache = rand(b, max_len, nkv, hd), rand(b, max_len, nkv, hd)
  pos = jnp.asarray([3, 13], jnp.int32)     # two blocks of 8 hold every cached token
  new = {"k": k_new, "v": v_new}
  out, _ = attention._attend_cached(q, {"k": k_cache, "v": v_cache}, new, pos, block=block)
  poisoned = lambda c: c.at[:, 2 * block:].set(jnp.nan)
  out_poisoned, _ = attention._attend_cached(
      q, {"k": poisoned(k_cache), "v": poisoned(v_cache)}, new, pos, block=block)
  np.testing.assert_array_equal(out, out_poisoned)


def test_decode_of_a_stacked_layer_equals_decode_of_that_layer_alone():
  """With `layer`, decode reads and writes its slot of the stacked caches (the layer scan's
  carry) and leaves the other layers' untouched."""
  cfg = _cfg(attention_impl="reference")
  params, x, positions = _inputs(cfg, seq=12)
  rng = np.random.default_rng(5)
  stacked = {n: jnp.asarray(rng.standard_normal((3, 2, 16, 2, 16)), jnp.float32) for n in "kv"}
  pos = jnp.asarray([5, 11], jnp.int32)
  alone_out, alone = attention.decode(params, x[:, :1], pos, jax.tree.map(lambda a: a[1], stacked),
                                      cfg)
  out, after = attention.decode(params, x[:, :1], pos, stacked, cfg, layer=jnp.int32(1))
  np.testing.assert_allclose(out, alone_out, atol=1e-6)
  for n in "kv":
    np.testing.assert_array_equal(after[n][1], alone[n])
    np.testing.assert_array_equal(after[n][0], stacked[n][0])
    np.testing.assert_array_equal(after[n][2], stacked[n][2])
