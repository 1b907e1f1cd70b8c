"""Decode path, padding, scanning, presets and checkpoint errors of the Qwen3.5 model."""
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.flax import load_file, save_file

from configs import base
from models import aot
from models import config as config_lib
from models import hf_io
from models import qwen3_5
from models import sharding
from models.layers import attention
from models.layers import gated_deltanet
from models.layers import moe
from tests.models import kernel_checks


def _tiny(**kw):
  m = base.get_model_config()
  m.update(kw)
  return qwen3_5.config_from_dict(m)


_init = jax.jit(qwen3_5.init_params, static_argnums=0)


@pytest.fixture(scope="module")
def model():
  """One layer cycle, top-3 routing: small enough that each test's compiles stay short."""
  cfg = _tiny(num_hidden_layers=4, num_experts_per_tok=3)
  return cfg, _init(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def two_cycle_model():
  cfg = _tiny(num_hidden_layers=8, num_experts_per_tok=3)
  return cfg, _init(cfg, jax.random.key(0))


_forward = jax.jit(qwen3_5.forward, static_argnums=0, static_argnames=("return_router_logits",))
_prefill = jax.jit(qwen3_5.prefill, static_argnums=0, static_argnames=("max_len",))


def test_prefill_then_decode_reproduces_full_forward(model):
  cfg, params = model
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 80)), jnp.int32)
  full = _forward(cfg, params, tokens)
  prompt = 70  # > one GDN chunk
  lengths = jnp.full((2,), prompt, jnp.int32)
  logits, cache = _prefill(cfg, params, tokens[:, :prompt], lengths, max_len=96)
  np.testing.assert_allclose(logits, full[:, prompt - 1], atol=1e-4)
  step = jax.jit(qwen3_5.decode_step, static_argnums=0)
  for t in range(prompt, 80):
    logits, cache = step(cfg, params, cache, tokens[:, t])
    np.testing.assert_allclose(logits, full[:, t], atol=1e-4, err_msg=f"position {t}")
  assert cache["pos"].tolist() == [80, 80]


@pytest.mark.parametrize("gdn_decode", ["xla", "fused"])
def test_a_decode_step_keeps_the_recurrent_states_of_rows_that_are_not_live(model, gdn_decode):
  """decode_step(live=...): a row that is not live keeps its Gated DeltaNet states (conv and S)
  bit for bit; a live row's step is the unmasked step's."""
  cfg, params = model
  cfg = cfg.replace(gdn_decode=gdn_decode)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (3, 9)), jnp.int32)
  _, cache = _prefill(cfg, params, tokens[:, :8], jnp.full((3,), 8, jnp.int32), max_len=16)
  step = jax.jit(qwen3_5.decode_step, static_argnums=0)
  live = jnp.asarray([True, False, True])
  logits, held = step(cfg, params, cache, tokens[:, 8], live)
  want_logits, moved = step(cfg, params, cache, tokens[:, 8])
  np.testing.assert_allclose(logits[live], want_logits[live], atol=1e-6)
  recurrent = [(b, k) for b, blk in enumerate(cache["blocks"]) for k in blk if k in ("conv", "ssm")]
  assert recurrent
  for b, k in recurrent:
    old, new, unmasked = (c["blocks"][b][k] for c in (cache, held, moved))
    np.testing.assert_array_equal(new[:, 1], old[:, 1])             # [cycles, rows, ...]
    assert not np.array_equal(unmasked[:, 1], old[:, 1])
    np.testing.assert_allclose(new[:, ::2], unmasked[:, ::2], atol=1e-6)


def test_right_padded_batch_rows_match_their_runs_alone(model):
  cfg, params = model
  rng = np.random.default_rng(1)
  lengths = [67, 12, 40]
  rows = [rng.integers(0, cfg.vocab_size, n) for n in lengths]
  padded = np.zeros((3, 72), np.int32)
  for i, r in enumerate(rows):
    padded[i, :len(r)] = r
  logits, cache = _prefill(cfg, params, jnp.asarray(padded), jnp.asarray(lengths), max_len=80)
  nxt = jnp.asarray([5, 6, 7], jnp.int32)
  step_logits, _ = jax.jit(qwen3_5.decode_step, static_argnums=0)(cfg, params, cache, nxt)
  batch_full = _forward(cfg, params, jnp.asarray(padded))
  for i, r in enumerate(rows):
    alone = _forward(cfg, params, jnp.asarray(np.append(r, int(nxt[i]))[None], jnp.int32))
    np.testing.assert_allclose(logits[i], alone[0, -2], atol=1e-4)
    np.testing.assert_allclose(step_logits[i], alone[0, -1], atol=1e-4)
    # The padded forward gives each row its own logits at its valid positions too.
    np.testing.assert_allclose(batch_full[i, :len(r)], alone[0, :-1], atol=1e-4)


_extend = jax.jit(qwen3_5.prefill_extend, static_argnums=0)
_decode = jax.jit(qwen3_5.decode_step, static_argnums=0)


@pytest.mark.parametrize("prefix_len", [64, 50])  # on a GDN chunk boundary, and off one
def test_prefill_extend_of_a_cached_prefix_matches_prefill_of_the_whole(model, prefix_len):
  cfg, params = model
  rng = np.random.default_rng(5)
  lengths = [prefix_len + 37, prefix_len + 5]
  rows = [rng.integers(0, cfg.vocab_size, n) for n in lengths]
  rows[1][:prefix_len] = rows[0][:prefix_len]   # one prefix, two continuations
  prefix = jnp.asarray(rows[0][:prefix_len][None], jnp.int32)
  _, prefix_cache = _prefill(cfg, params, prefix, jnp.asarray([prefix_len]), max_len=prefix_len)
  both = {"pos": jnp.concatenate([prefix_cache["pos"]] * 2),   # cache leaves: [cycles, batch, ...]
          "blocks": jax.tree.map(lambda a: jnp.concatenate([a, a], axis=1), prefix_cache["blocks"])}
  rest = np.zeros((2, 48), np.int32)   # right-padded continuations
  for i, r in enumerate(rows):
    rest[i, :len(r) - prefix_len] = r[prefix_len:]
  rest_len = jnp.asarray([n - prefix_len for n in lengths], jnp.int32)
  logits, cache = _extend(cfg, params, both, jnp.asarray(rest), rest_len)
  assert cache["pos"].tolist() == lengths
  assert cache["blocks"][3]["k"].shape[2] == prefix_len + 48
  nxt = jnp.asarray([5, 6], jnp.int32)
  step_logits, _ = _decode(cfg, params, cache, nxt)
  whole = np.zeros((2, 128), np.int32)   # right padding: causal, so it changes nothing before it
  for i, r in enumerate(rows):
    whole[i, :len(r) + 1] = np.append(r, int(nxt[i]))
  full = _forward(cfg, params, jnp.asarray(whole))
  for i, n in enumerate(lengths):
    np.testing.assert_allclose(logits[i], full[i, n - 1], atol=1e-4)
    # The decode after it reads the prefix's keys and the continuation's from one cache.
    np.testing.assert_allclose(step_logits[i], full[i, n], atol=1e-4)


def test_query_chunked_and_causal_block_extend_match_one_block(model):
  cfg, params = model
  p = jax.tree.map(lambda a: a[0], params["blocks"][3]["mixer"])   # the attention layer
  x = jax.random.normal(jax.random.key(6), (1, 75, cfg.hidden_size))
  pos = jnp.arange(75)[None]
  kv = jnp.zeros((1, 30, cfg.num_key_value_heads, cfg.head_dim))
  _, cache = jax.jit(lambda p, x: attention.forward(p, x, pos[:, :30], cfg,
                                                   cache={"k": kv, "v": kv}))(p, x[:, :30])
  whole = jax.jit(lambda p, x: attention.forward(p, x, pos, cfg)[0])(p, x)[:, 30:]
  # 45 queries = 2 blocks + a padded one (query chunks) or a short one (causal blocks).
  for c in (cfg, cfg.replace(attention_query_chunk=16), cfg.replace(attention_causal_block=16),
            cfg.replace(attention_query_chunk=8, attention_causal_block=24)):
    out = jax.jit(lambda p, x, cache, c=c: attention.extend(p, x, pos[:, 30:], cache, c)[0])(
        p, x[:, 30:], cache)
    np.testing.assert_allclose(out, whole, atol=1e-5)


_append = jax.jit(qwen3_5.prefill_append, static_argnums=0)


@pytest.mark.parametrize("query_chunk", [0, 16])
def test_prefill_append_continues_a_decoded_turn_as_prefill_of_the_whole(model, query_chunk):
  """A turn: prompt prefilled, reply decoded token by token into a slot (the recurrent rule);
  the next turn's tokens appended in place to that slot's cache give the whole sequence's
  logits, and decoding after them reads every turn from the one cache."""
  cfg, params = model
  cfg = cfg.replace(attention_query_chunk=query_chunk)
  rng = np.random.default_rng(8)
  prompt, reply, nxt_turn, max_len = 70, 9, 41, 160
  seq = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, prompt + reply + nxt_turn + 1)), jnp.int32)
  _, cache = _prefill(cfg, params, seq[:, :prompt], jnp.asarray([prompt]), max_len=max_len)
  for t in range(prompt, prompt + reply):
    _, cache = _decode(cfg, params, cache, seq[:, t])
  # Another sequence shares the decode state; the finished turn is its slot, taken as a row.
  other = jax.tree.map(lambda a: jnp.zeros_like(a), cache)
  both = {"pos": jnp.concatenate([other["pos"], cache["pos"]]),
          "blocks": jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), other["blocks"],
                                 cache["blocks"])}
  turn = jax.jit(qwen3_5.cache_row)(both, 1)
  assert jax.tree.map(jnp.shape, turn) == jax.tree.map(jnp.shape, cache)
  start = prompt + reply
  rest = np.zeros((1, 64), np.int32)   # padded to a bucket, as the engine does
  rest[0, :nxt_turn] = seq[0, start:start + nxt_turn]
  logits, cache = _append(cfg, params, turn, jnp.asarray(rest), jnp.asarray([nxt_turn]))
  assert cache["pos"].tolist() == [start + nxt_turn]
  assert cache["blocks"][3]["k"].shape[2] == max_len    # written in place, capacity unchanged
  step_logits, _ = _decode(cfg, params, cache, seq[:, start + nxt_turn])
  full = _forward(cfg, params, seq)
  np.testing.assert_allclose(logits[0], full[0, start + nxt_turn - 1], atol=1e-4)
  np.testing.assert_allclose(step_logits[0], full[0, start + nxt_turn], atol=1e-4)


def test_cache_insert_moves_one_sequence_into_a_slot(model):
  cfg, params = model
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 20)), jnp.int32)
  _, prefix = _prefill(cfg, params, tokens, jnp.asarray([20]), max_len=32)
  decode = qwen3_5.init_cache(cfg, batch=4, max_len=64)
  decode = qwen3_5.cache_insert(decode, prefix, slot=2)
  assert decode["pos"].tolist() == [0, 0, 20, 0]
  logits, _ = qwen3_5.decode_step(cfg, params, decode, jnp.asarray([0, 0, 9, 0]))
  ref = _forward(cfg, params, jnp.concatenate([tokens, jnp.asarray([[9]])], axis=1))
  np.testing.assert_allclose(logits[2], ref[0, -1], atol=1e-4)


# Slow (`make test-all`, CI; ~70 s here): the quick suite serves the scanned model's greedy tokens
# from unscanned layers (tests/rl/rollout/test_rollout_server.py, prefill and decode).
@pytest.mark.slow
def test_unscanned_layers_give_the_scanned_models_logits_prefill_extend_and_decode(
    two_cycle_model):
  """`unscan_layers` regroups the scanned params (2 cycles of 4) as the model with
  scan_layers=False holds them (one cycle of 8 layers, a serving engine's layout): its
  param_axes name every leaf, and it gives the scanned model's logits, prefill, extend and
  decode (a row not live keeps its states)."""
  cfg, params = two_cycle_model
  flat_cfg = cfg.replace(scan_layers=False)
  assert cfg.num_cycles == 2 and flat_cfg.num_cycles == 1
  flat = qwen3_5.unscan_layers(cfg, params)
  assert cfg.cycle == ("linear_attention",) * 3 + ("full_attention",)
  # Layer 7 is cycle 1's attention layer.
  np.testing.assert_array_equal(flat["blocks"][7]["mixer"]["q_proj"][0],
                                params["blocks"][3]["mixer"]["q_proj"][1])
  is_axes = lambda a: isinstance(a, tuple) and all(isinstance(n, (str, type(None))) for n in a)
  axes = qwen3_5.param_axes(flat_cfg)
  assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(flat)
  for names, x in zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(flat)):
    assert len(names) == x.ndim
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 30)), jnp.int32)
  np.testing.assert_allclose(_forward(flat_cfg, flat, tokens),
                             _forward(cfg, params, tokens), atol=1e-5)
  lengths = jnp.asarray([8, 5], jnp.int32)
  runs = []
  for c, p in ((cfg, params), (flat_cfg, flat)):
    out, cache = _prefill(c, p, tokens[:, :8], lengths, max_len=16)
    ext, _ = _extend(c, p, cache, tokens[:, 8:12], jnp.asarray([4, 4], jnp.int32))
    step, after = _decode_live(c, p, cache, tokens[:, 8], jnp.asarray([True, False]))
    # The caches hold the same layers in the two layouts: compare them layer by layer.
    runs.append((out, ext, step, jax.tree.leaves(qwen3_5.unscan_layers(c, after)
                                                  if c.scan_layers else after)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), *runs)


_decode_live = jax.jit(
    lambda cfg, p, c, t, live: qwen3_5.decode_step(cfg, p, c, t, live=live), static_argnums=0)


def _loss_and_grads(cfg, params, tokens):
  def loss(p):
    logits = qwen3_5.forward(cfg, p, tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.fixture(scope="module")
def scanned_reference(two_cycle_model):
  """Tokens, and the logits and gradients of a scan of one cycle a step (scan_unroll=1)."""
  cfg, params = two_cycle_model
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
  (_, logits), grads = _loss_and_grads(cfg.replace(scan_unroll=1), params, tokens)
  return tokens, logits, grads


# Not -1 (auto): on this 2-cycle model it resolves to 2, the same program as the case 2
# (test_auto_scan_unroll_unrolls_shallow_models_and_scans_deep_ones checks the resolution).
# Fully unrolled (0) is slow (`make test-all`, CI; ~50 s of compile): 2 stays in the quick suite.
@pytest.mark.parametrize("unroll", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_scan_unroll_gives_the_same_logits_and_gradients(two_cycle_model, scanned_reference,
                                                         unroll):
  cfg, params = two_cycle_model
  tokens, ref_logits, ref_grads = scanned_reference
  (_, logits), grads = _loss_and_grads(cfg.replace(scan_unroll=unroll), params, tokens)
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads, ref_grads)


def test_auto_scan_unroll_unrolls_shallow_models_and_scans_deep_ones(two_cycle_model):
  """Shallow: up to 2 layer cycles (4 on a GPU); deeper models, and any under remat, scan
  one cycle a step."""
  cfg, _ = two_cycle_model
  assert cfg.num_cycles == 2
  assert qwen3_5.scan_unroll(cfg.replace(scan_unroll=-1)) == 2
  deep = cfg.replace(num_hidden_layers=12, layer_types=tuple(cfg.cycle) * 3, scan_unroll=-1)
  assert qwen3_5.scan_unroll(deep) == 1
  assert qwen3_5.scan_unroll(deep.replace(scan_unroll=0)) == 3
  assert qwen3_5.scan_unroll(deep.replace(scan_unroll=2)) == 2
  # On a GPU auto unrolls up to 4 cycles (the 3 here); deeper models scan one cycle a step,
  # and so does any model under remat (the loop keeps the recomputation in the backward).
  assert qwen3_5.scan_unroll(deep, backend="gpu") == 3
  assert qwen3_5.scan_unroll(deep.replace(remat="full"), backend="gpu") == 1
  assert qwen3_5.scan_unroll(cfg.replace(scan_unroll=-1, remat="full")) == 1
  deeper = cfg.replace(num_hidden_layers=20, layer_types=tuple(cfg.cycle) * 5, scan_unroll=-1)
  assert qwen3_5.scan_unroll(deeper, backend="gpu") == 1
  with pytest.raises(ValueError, match="scan_unroll"):
    cfg.replace(scan_unroll=-2)


def test_router_logits_are_returned_per_moe_layer(model):
  cfg, params = model
  tokens = jnp.zeros((2, 10), jnp.int32)
  _, router = _forward(cfg, params, tokens, return_router_logits=True)
  assert len(router) == len(cfg.cycle)
  assert all(r.shape == (cfg.num_cycles, 20, cfg.num_experts) and r.dtype == jnp.float32
             for r in router)


def test_param_axes_name_every_parameter_dimension(model):
  cfg, params = model
  axes = qwen3_5.param_axes(cfg)
  is_axes = lambda a: isinstance(a, tuple) and all(isinstance(x, str) for x in a)
  flat_axes = jax.tree_util.tree_flatten(axes, is_leaf=is_axes)[0]
  flat_params = jax.tree_util.tree_flatten(params)[0]
  assert len(flat_axes) == len(flat_params)
  for a, p in zip(flat_axes, flat_params):
    assert len(a) == p.ndim, (a, p.shape)


@pytest.mark.parametrize("preset,total,active", [
    ("qwen3_5_35b_a3b", 35e9, 3e9),
    ("qwen3_5_397b_a17b", 397e9, 17e9),
])
def test_presets_match_their_names_within_five_percent(preset, total, active):
  counts = qwen3_5.count_params(_tiny(preset=preset))
  assert abs(counts["total"] / total - 1) <= 0.05, counts
  assert abs(counts["active"] / active - 1) <= 0.05, counts


def test_unknown_preset_and_bad_config_are_clear_errors():
  with pytest.raises(ValueError, match="unknown model preset"):
    _tiny(preset="qwen9")
  with pytest.raises(ValueError, match="linear_num_value_heads"):
    _tiny(linear_num_value_heads=3)


def test_dense_model_runs_and_round_trips(tmp_path):
  cfg = _tiny(use_moe=False, tie_word_embeddings=True)
  params = qwen3_5.init_params(cfg, jax.random.key(1))
  assert "lm_head" not in params
  path = qwen3_5.save_hf(cfg, params, str(tmp_path / "dense"))
  cfg2, params2 = qwen3_5.load_hf(path)
  assert cfg2.use_moe is False and cfg2.tie_word_embeddings
  tokens = jnp.ones((1, 5), jnp.int32)
  np.testing.assert_array_equal(qwen3_5.forward(cfg2, params2, tokens),
                                qwen3_5.forward(cfg, params, tokens))


# -- checkpoint layouts and errors ------------------------------------------------------------

@pytest.fixture()
def saved(tmp_path, model):
  cfg, params = model
  return cfg, params, qwen3_5.save_hf(cfg, params, str(tmp_path / "ckpt"))


def _rewrite(path, fn):
  f = os.path.join(path, "model.safetensors")
  tensors = fn(dict(load_file(f)))
  save_file(tensors, f, metadata={"format": "pt"})


def _save_text_only_fused(cfg, params, flat_dir):
  """`params` in the text-only layout (flat config, keys under `model.`, fused experts)."""
  flat_dir.mkdir()
  tensors = hf_io.to_hf_tensors(cfg, jax.device_get(params), prefix="model.")
  for key in [k for k in tensors if k.endswith(".mlp.experts.0.gate_proj.weight")]:
    base_key = key[: -len("0.gate_proj.weight")]
    e = cfg.num_experts
    gate = np.stack([tensors.pop(f"{base_key}{i}.gate_proj.weight") for i in range(e)])
    up = np.stack([tensors.pop(f"{base_key}{i}.up_proj.weight") for i in range(e)])
    tensors[base_key + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
    tensors[base_key + "down_proj"] = np.stack(
        [tensors.pop(f"{base_key}{i}.down_proj.weight") for i in range(e)])
  tensors["mtp.layers.0.fc.weight"] = np.zeros((2, 2), np.float32)  # ignored
  save_file({k: jnp.asarray(v) for k, v in tensors.items()}, str(flat_dir / "model.safetensors"))
  with open(flat_dir / "config.json", "w") as f:
    json.dump(config_lib.to_hf_text_dict(cfg), f)
  return flat_dir


def test_sharded_index_and_text_only_fused_layouts_load_identically(saved, tmp_path):
  cfg, params, _ = saved
  sharded = qwen3_5.save_hf(cfg, params, str(tmp_path / "sharded"), max_shard_bytes=200_000)
  assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
  _, p_sharded = qwen3_5.load_hf(sharded)
  jax.tree.map(np.testing.assert_array_equal, p_sharded, params)

  # The text-only layout: flat config, keys under `model.`, experts fused as transformers keeps them.
  flat_dir = _save_text_only_fused(cfg, params, tmp_path / "text_only")
  cfg_flat, p_flat = qwen3_5.load_hf(str(flat_dir))
  assert cfg_flat == cfg.replace(intermediate_size=0)  # the dense width is not part of a MoE config
  jax.tree.map(np.testing.assert_array_equal, p_flat, params)


def test_missing_tensor_is_named(saved):
  _, _, path = saved
  key = "model.language_model.layers.3.self_attn.k_norm.weight"
  _rewrite(path, lambda t: {k: v for k, v in t.items() if k != key})
  with pytest.raises(hf_io.CheckpointError, match=f"missing tensor {key}"):
    qwen3_5.load_hf(path)


def test_extra_tensor_is_named(saved):
  _, _, path = saved
  _rewrite(path, lambda t: dict(t, **{"model.language_model.layers.0.bogus": jnp.zeros(3)}))
  with pytest.raises(hf_io.CheckpointError, match="unexpected tensors.*layers.0.bogus"):
    qwen3_5.load_hf(path)


def test_misshapen_tensor_is_named(saved):
  _, _, path = saved
  key = "model.language_model.layers.1.linear_attn.in_proj_z.weight"
  _rewrite(path, lambda t: dict(t, **{key: jnp.zeros((3, 3))}))
  with pytest.raises(hf_io.CheckpointError, match=f"tensor {key} has shape"):
    qwen3_5.load_hf(path)


def test_corrupt_shard_is_reported(saved):
  _, _, path = saved
  f = os.path.join(path, "model.safetensors")
  with open(f, "r+b") as fh:
    fh.truncate(os.path.getsize(f) // 2)
  with pytest.raises(hf_io.CheckpointError):
    qwen3_5.load_hf(path)


@pytest.mark.parametrize("knobs", [dict(attention_query_chunk=16), dict(attention_causal_block=16),
                                   dict(attention_query_chunk=8, attention_causal_block=24)])
def test_blocked_attention_matches_one_block(model, knobs):
  cfg, params = model
  p = jax.tree.map(lambda a: a[0], params["blocks"][3]["mixer"])   # the attention layer
  x = jax.random.normal(jax.random.key(4), (2, 45, cfg.hidden_size))
  pos = jnp.broadcast_to(jnp.arange(45), (2, 45))
  chunked = cfg.replace(**knobs)  # 45 = 2 full blocks + a partial one (or 24 + 21 in chunks of 8)

  def loss(c, p, x):
    return jnp.sum(jnp.sin(attention.forward(p, x, pos, c)[0]))

  np.testing.assert_allclose(attention.forward(p, x, pos, chunked)[0],
                             attention.forward(p, x, pos, cfg)[0], atol=1e-5)
  g_chunked = jax.jit(jax.grad(lambda p, x: loss(chunked, p, x), argnums=(0, 1)))(p, x)
  g_ref = jax.jit(jax.grad(lambda p, x: loss(cfg, p, x), argnums=(0, 1)))(p, x)
  for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(jnp.abs(b).max())))


def test_chunked_token_logprobs_match_full_logits(model):
  cfg, params = model
  hidden = jax.random.normal(jax.random.key(5), (2, 37, cfg.hidden_size))
  targets = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 37)), jnp.int32)
  chunked = cfg.replace(logits_chunk=8)

  def f(c, p, h):
    return qwen3_5.token_logprobs(c, p, h, targets, temperature=0.7)

  lp, ent = f(chunked, params, hidden)
  ref_logp = jax.nn.log_softmax(qwen3_5.logits_from_hidden(cfg, params, hidden) / 0.7)
  np.testing.assert_allclose(lp, jnp.take_along_axis(ref_logp, targets[..., None], -1)[..., 0],
                             atol=1e-5)
  np.testing.assert_allclose(ent, -jnp.sum(jnp.exp(ref_logp) * ref_logp, -1), atol=1e-4)
  grad = lambda c: jax.jit(jax.grad(lambda p, h: jnp.sum(f(c, p, h)[0]), argnums=(0, 1)))
  for a, b in zip(jax.tree.leaves(grad(chunked)(params, hidden)),
                  jax.tree.leaves(grad(cfg)(params, hidden))):
    np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(jnp.abs(b).max())))


def test_head_values_and_gradients_are_log_softmaxs(model):
  """The LM head's logprob and entropy (from one max and two exp-sums) and its hand-written
  gradient (the logits recomputed, the saved log-sum-exp) equal log_softmax's and autodiff's,
  for any mix of the two outputs' cotangents."""
  cfg, params = model
  hidden = jax.random.normal(jax.random.key(6), (2, 19, cfg.hidden_size))
  targets = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 19)), jnp.int32)
  g_lp, g_ent = jax.random.normal(jax.random.key(7), (2, 2, 19))

  def reference(p, h):
    logp = jax.nn.log_softmax(qwen3_5.logits_from_hidden(cfg, p, h) / 0.7)
    return (jnp.take_along_axis(logp, targets[..., None], -1)[..., 0],
            -jnp.sum(jnp.exp(logp) * logp, -1))

  def head(p, h):
    return qwen3_5.token_logprobs(cfg, p, h, targets, temperature=0.7)

  for got, want in zip(head(params, hidden), reference(params, hidden)):
    np.testing.assert_allclose(got, want, atol=1e-5)
  weighted = lambda f: lambda p, h: jnp.sum(f(p, h)[0] * g_lp + f(p, h)[1] * g_ent)
  grads = lambda f: jax.jit(jax.grad(weighted(f), argnums=(0, 1)))(params, hidden)
  for a_, b_ in zip(jax.tree.leaves(grads(head)), jax.tree.leaves(grads(reference))):
    np.testing.assert_allclose(a_, b_, atol=1e-5 * max(1.0, float(jnp.abs(b_).max())))


def test_head_backward_matmuls_take_the_activation_dtype(model):
  """In bfloat16 the logits' cotangent meets the LM head's two backward matmuls as bfloat16
  (float32 accumulation), as the forward matmul's operands are; the gradients are the float32
  cotangent's to bfloat16's rounding."""
  cfg, params = model
  bf16 = cfg.replace(dtype="bfloat16")
  hidden = jax.random.normal(jax.random.key(6), (2, 19, cfg.hidden_size))
  targets = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 19)), jnp.int32)

  def loss(c, p, h):
    lp, ent = qwen3_5.token_logprobs(c, p, h, targets, temperature=0.7)
    return jnp.sum(lp) + 0.1 * jnp.sum(ent)

  jaxpr = jax.make_jaxpr(jax.grad(lambda p, h: loss(bf16, p, h), argnums=(0, 1)))(params, hidden)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  vocab_dots = [e for e in dots if any(cfg.vocab_size in v.aval.shape for v in e.invars)]
  assert len(vocab_dots) == 4   # forward, its recompute, and the cotangent against w and h
  for e in vocab_dots:
    assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16] * 2, e
    assert e.outvars[0].aval.dtype == jnp.float32, e

  def float32_cotangent(c, p, h):   # autodiff's transpose: the cotangent stays float32
    w = p["lm_head"].astype(jnp.bfloat16)
    logits = jnp.dot(h.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32) / 0.7
    logp = jax.nn.log_softmax(logits)
    ent = -jnp.sum(jnp.exp(logp) * logp, -1)
    return jnp.sum(jnp.take_along_axis(logp, targets[..., None], -1)) + 0.1 * jnp.sum(ent)

  got = jax.jit(jax.grad(lambda p, h: loss(bf16, p, h), argnums=(0, 1)))(params, hidden)
  want = jax.jit(jax.grad(lambda p, h: float32_cotangent(bf16, p, h), argnums=(0, 1)))(
      params, hidden)
  np.testing.assert_allclose(got[0]["lm_head"], want[0]["lm_head"],
                             atol=2e-2 * float(jnp.abs(want[0]["lm_head"]).max()))
  np.testing.assert_allclose(got[1], want[1], atol=2e-2 * float(jnp.abs(want[1]).max()))


def _largest_collective(hlo: str) -> int:
  """Elements of the largest array any collective of an HLO module moves."""
  comps, _ = aot._parse_module(hlo)
  return max((math.prod(dims) for instrs in comps.values() for ins in instrs
              if ins.op.removesuffix("-start") in aot.COLLECTIVES
              for _, dims in aot._arrays(ins.type_str)), default=0)


@pytest.mark.parametrize("part", ["lm_head", "moe", "gated_deltanet"])
def test_under_context_parallelism_no_layer_moves_a_whole_micro_batchs_activations(part):
  """Rows split by position over 8 devices (fsdp x expert of a 1x2x4x1 mesh, the 35B-A3B
  config's layout at half the size): each part's forward and backward give the one-device
  gradients, and none of its collectives moves an array as large as the micro-batch's [batch,
  seq, embed] activations. Before, the LM head summed each block's [positions, vocab] logits
  over devices (and the whole [embed, vocab] weight's gradient), the MoE's shared expert
  gathered the whole rows it took flattened, and the Gated DeltaNet gathered its input x whole
  for the projections (on 16 H200s, compiler figures: 95k, 8k and 19k GiB a GPU a step of
  35B-A3B's RL step)."""
  mesh, rules = kernel_checks.split_rows_mesh((1, 2, 4, 1))
  # 8 value heads, one a device: the Gated DeltaNet splits its rows by head (its 4 key heads,
  # which the 8 devices do not split evenly, repeated to the value heads first).
  cfg = _tiny(num_hidden_layers=4, num_experts_per_tok=3, dtype="float32", logits_chunk=16,
              linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
              linear_value_head_dim=8)
  params = _init(cfg, jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (2, 128, cfg.hidden_size))
  targets = jax.random.randint(jax.random.key(2), x.shape[:2], 0, cfg.vocab_size)
  layer = jax.tree.map(lambda a: a[0], params["blocks"][0])
  squares = lambda tree: sum(jnp.sum(a.astype(jnp.float32) ** 2) for a in jax.tree.leaves(tree))

  def gdn_loss(p, x):  # a right-padded row: its states are taken at its length
    return squares(gated_deltanet.forward(p, x, cfg, lengths=jnp.array([128, 100])))

  loss, p = {"lm_head": (lambda p, x: squares(qwen3_5.token_logprobs(cfg, p, x, targets, 0.7)[0]),
                         params),
             "moe": (lambda p, x: squares(moe.forward(p, x, cfg)[0]), layer["ffn"]),
             "gated_deltanet": (gdn_loss, layer["mixer"])}[part]
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  want, got, hlo = kernel_checks.one_device_and_split_rows(grad, p, x, mesh, rules)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=1e-5 * max(1.0, float(jnp.abs(w).max())))
  assert _largest_collective(hlo) < x.size, _largest_collective(hlo)


def test_a_blocked_heads_weight_gradient_crosses_the_batchs_devices_once_not_once_a_block():
  """Rows split over `fsdp` (a row a node in 35B-A3B's layout), positions over `expert`, the
  LM head's logits taken 16 positions at a time (8 blocks): the same values and gradients as
  one device, and the head weight's gradient is summed over the rows' devices once, after the
  blocks (`qwen3_5._grouped_head_block`): less than two of its [embed, vocab / 4] shards in
  all-reduces, where a sum in every block moved eight."""
  cfg = _tiny(num_hidden_layers=4, dtype="float32", logits_chunk=16)
  params = _init(cfg, jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (2, 128, cfg.hidden_size))
  targets = jax.random.randint(jax.random.key(2), x.shape[:2], 0, cfg.vocab_size)
  c = base.get_config()
  c.mesh.shape = (1, 2, 4, 1)
  rules = sharding.context_parallel_rules(sharding.rules_from_config(c.mesh.rules), ("expert",))
  squares = lambda tree: sum(jnp.sum(a ** 2) for a in jax.tree.leaves(tree))
  grad = jax.jit(jax.value_and_grad(
      lambda p, x: squares(qwen3_5.token_logprobs(cfg, p, x, targets, 0.7)[0]), argnums=(0, 1)))
  want, got, hlo = kernel_checks.one_device_and_split_rows(grad, params, x,
                                                           sharding.make_mesh(c.mesh), rules)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=1e-5 * max(1.0, float(jnp.abs(w).max())))
  coll = aot.hlo_costs(hlo)["collectives"]
  summed = sum(coll.get(k, {}).get("bytes", 0) for k in ("all-reduce", "reduce-scatter"))
  assert summed < 2 * params["lm_head"].nbytes / 4, coll


def _param_shardings(cfg, mesh_shape):
  c = base.get_config()
  with c.mesh.unlocked():
    c.mesh.shape = mesh_shape
  mesh = sharding.make_mesh(c.mesh)
  shapes = jax.eval_shape(lambda k: qwen3_5.init_params(cfg, k), jax.random.key(0))
  return sharding.tree_shardings(qwen3_5.param_axes(cfg), shapes, mesh,
                                 sharding.rules_from_config(c.mesh.rules))


@pytest.mark.parametrize("layout", ["hub", "text_only_fused"])
def test_sharded_load_builds_each_param_on_its_devices_equal_to_the_whole_load(saved, tmp_path,
                                                                               layout, monkeypatch):
  cfg, params, path = saved
  if layout == "text_only_fused":
    path = str(_save_text_only_fused(cfg, params, tmp_path / "fused"))
  shardings = _param_shardings(cfg, (1, 2, 2, 2))
  reads = []
  real_get = hf_io._TensorSource.get

  def counting_get(self, key, index=None):
    out = real_get(self, key, index)
    reads.append((key, out.nbytes, int(np.prod(self.shape(key))) * 4))
    return out
  monkeypatch.setattr(hf_io._TensorSource, "get", counting_get)
  _, got = qwen3_5.load_hf(path, shardings=shardings)
  for (p, a), want, sh in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                              jax.tree.leaves(params), jax.tree.leaves(shardings)):
    assert a.sharding.is_equivalent_to(sh, a.ndim), jax.tree_util.keystr(p)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(want), err_msg=jax.tree_util.keystr(p))
  # Experts are split over the expert axis (2) and their matrices over fsdp x tensor (2 x 2):
  # a read of a per-expert matrix is a quarter of it; of a fused tensor, an eighth (down_proj)
  # or a sixteenth (gate_up_proj holds both halves).
  share = {"hub": 4, "text_only_fused": 8}[layout]
  expert_reads = [(k, n * share * (2 if k.endswith("gate_up_proj") else 1), total)
                  for k, n, total in reads if ".mlp.experts." in k]
  assert expert_reads
  assert all(n == total for _, n, total in expert_reads), expert_reads[:3]


def test_sharded_load_checks_shapes_before_reading_any_tensor(saved, monkeypatch):
  _, _, path = saved
  key = "model.language_model.layers.1.linear_attn.in_proj_z.weight"
  _rewrite(path, lambda t: dict(t, **{key: jnp.zeros((3, 3))}))
  monkeypatch.setattr(hf_io._TensorSource, "get",
                      lambda *a, **k: pytest.fail("a tensor was read before the check"))
  with pytest.raises(hf_io.CheckpointError, match=f"tensor {key} has shape"):
    qwen3_5.load_hf(path, shardings=_param_shardings(hf_io.read_config(path), (1, 8, 1, 1)))


@pytest.mark.parametrize("layers", [8, 16])   # the layer cycles unrolled (2), and scanned (4)
def test_decode_step_temporaries_do_not_grow_with_the_cache_capacity(layers):
  """The donated cache is written and read in place: the compiled step's temporaries are the
  same at 4,096 and 16,384 positions and a small part of the cache, where a step that passed
  the caches through the layer scan's inputs and outputs held 1.4x the cache (185 MB for a
  135 MB cache at 16,384)."""
  cfg = _tiny(num_hidden_layers=layers)
  params = jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0)))
  step = jax.jit(qwen3_5.decode_step, static_argnums=0, donate_argnums=2)
  temp, cache_bytes = {}, {}
  for max_len in (4096, 16384):
    cache = jax.eval_shape(lambda: qwen3_5.init_cache(cfg, 8, max_len))
    compiled = step.lower(cfg, params, cache, jax.ShapeDtypeStruct((8,), jnp.int32)).compile()
    temp[max_len] = compiled.memory_analysis().temp_size_in_bytes
    cache_bytes[max_len] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
  assert temp[16384] <= 1.1 * temp[4096], temp
  assert temp[16384] < 0.1 * cache_bytes[16384], (temp, cache_bytes)


def test_the_gpu_decode_step_neither_transposes_nor_copies_the_gated_deltanet_state():
  """Compiled for an H200 from this CPU, the decode step reads and writes each Gated DeltaNet
  layer's state in place: no kernel outside the layer loop transposes or copies a stacked
  state (with the state stored [.., d_k, d_v] and scanned as the loop's inputs and outputs,
  each step transposed every state into the loop's d_k-minor layout and back, and copied it)."""
  cfg = _tiny(num_hidden_layers=8, linear_key_head_dim=32, linear_value_head_dim=64)
  hlo = _h200_decode_hlo(cfg)
  cache = jax.eval_shape(lambda: qwen3_5.init_cache(cfg, 8, 256))
  ssm = next(b["ssm"].shape for b in cache["blocks"] if "ssm" in b)
  assert ssm[-2:] == (64, 32)                               # stored [.., d_v, d_k]
  state = "f32[" + ",".join(map(str, ssm)) + "]"
  entry = hlo[hlo.index("\nENTRY "):]
  moved = [line for line in entry.splitlines()
           if line.lstrip().startswith("%") and f"= {state}" in line
           and (" copy(" in line or "transpose" in line.split("=")[0])]
  assert not moved, moved


def _h200_decode_hlo(cfg, slots=8, max_len=256) -> str:
  """The decode step of `cfg` compiled for one H200 from this CPU (cache donated)."""
  dev = aot.target_devices("h200:1x1")[0]
  on = jax.sharding.SingleDeviceSharding(dev)
  shaped = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), tree)
  params = shaped(jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0))))
  cache = shaped(jax.eval_shape(lambda: qwen3_5.init_cache(cfg, slots, max_len)))
  tokens = jax.ShapeDtypeStruct((slots,), jnp.int32, sharding=on)
  with config_lib.compiling_for("gpu"):
    step = jax.jit(qwen3_5.decode_step, static_argnums=0, donate_argnums=2)
    return step.lower(cfg, params, cache, tokens).compile().as_text()


@pytest.mark.parametrize("experts", [8, 32])
def test_the_gpu_decode_step_with_fused_experts_copies_no_expert_matrix(experts):
  """moe_dispatch=blocked_fused, compiled for an H200: the decode step's expert matmuls read
  every layer's stacked experts in place (Triton kernels), where `blocked` gathers each block's
  expert matrices and a kernel handed the layer scan's slice of the stack copies it whole. With
  32 experts the 8 slots' 16 pairs are fewer than the experts: one-row blocks in token order
  (moe._pair_experts), whose kernel sums products instead of Triton's dot."""
  cfg = _tiny(num_hidden_layers=8, hidden_size=64, moe_intermediate_size=32,
              num_experts=experts)
  experts_shaped = re.compile(r"= [a-z0-9]+\[(?:\d+,)*(64,32|32,64)\]")
  moved = lambda hlo: [l for l in hlo.splitlines() if experts_shaped.search(l)
                       and re.search(r" (fusion|copy|gather|dynamic-slice)\(", l)
                       and "parameter(" not in l]
  assert moved(_h200_decode_hlo(cfg.replace(moe_dispatch="blocked")))
  fused = _h200_decode_hlo(cfg.replace(moe_dispatch="blocked_fused"))
  assert not moved(fused), moved(fused)[:3]
  assert 'custom_call_target="__gpu$xla.gpu.triton"' in fused


def test_the_gpu_decode_step_with_the_fused_state_update_reads_and_writes_each_state_in_place():
  """gdn_decode=fused, compiled for an H200: each Gated DeltaNet state is touched only by its
  layer's Triton kernel, which updates it in place in the stacked carry; XLA's step makes new
  states in separate kernels (reading S for the prediction, the update and the output) and
  copies each into the stack."""
  cfg = _tiny(num_hidden_layers=8)
  state = re.compile(r"= f32\[(?:\d+,)?8,%d,%d,%d\]" % (
      cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim))
  made = lambda hlo: [l for l in hlo.splitlines() if state.search(l)
                      and re.search(r" (fusion|copy|dynamic-update-slice)\(", l)]
  assert made(_h200_decode_hlo(cfg))
  fused = _h200_decode_hlo(cfg.replace(gdn_decode="fused"))
  assert not made(fused), made(fused)[:3]
  stack = re.compile(r"f32\[2,8,%d,%d,%d\]" % (
      cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim))
  in_place = [l for l in fused.splitlines() if stack.search(l) and " custom-call(" in l]
  # One a Gated DeltaNet layer of the cycle (of every cycle where the layer scan is unrolled).
  assert in_place and len(in_place) % cfg.cycle.count("linear_attention") == 0


def test_the_unscanned_gpu_decode_step_copies_no_weight():
  """Compiled for an H200 with every GPU kernel: the layer scan slices each layer's weights out
  of the stacks, and XLA copies slices before their matmuls (kernels whose result is one
  layer's weight); the model with scan_layers=False (how `rollout.scan_layers=False` serves)
  reads each weight where it is, in fewer kernels."""
  # Three layer cycles (scanned), bfloat16, 64 experts top-2: at the tiny defaults XLA reads
  # the stacks' slices inside its matmul kernels.
  cfg = _tiny(num_hidden_layers=12, hidden_size=256, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
              linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
              num_experts=64, num_experts_per_tok=2, moe_intermediate_size=128,
              shared_expert_intermediate_size=128, param_dtype="bfloat16", dtype="bfloat16",
              moe_dispatch="blocked_fused", decode_attention="fused", gdn_decode="fused")
  flat_cfg = cfg.replace(scan_layers=False)
  flat = jax.eval_shape(lambda: qwen3_5.init_params(flat_cfg, jax.random.key(0)))
  weight_shapes = {",".join(map(str, x.shape[1:])) for x in jax.tree.leaves(flat["blocks"])
                   if x.ndim >= 3}
  # A copy or a kernel (not a matmul) whose result is one layer's weight ([1, ...] where a
  # slice of the stack keeps its axis). Not counted: XLA's concatenations of two weights that
  # meet the same input (its dot merger: gate with up), made whichever the layout.
  result = re.compile(r"= [a-z0-9]+\[(?:1,)?([0-9,]+)\]\{[^}]*\} (fusion|copy)\(")
  copies = lambda hlo: [l for l in hlo.splitlines()
                        if (m := result.search(l)) and m.group(1) in weight_shapes
                        and "kind=kCustom" not in l and "concatenate" not in l]
  scanned = _h200_decode_hlo(cfg)
  unscanned = _h200_decode_hlo(flat_cfg)
  assert copies(scanned)
  assert not copies(unscanned), copies(unscanned)[:3]
  assert aot.hlo_costs(unscanned)["kernels"] < aot.hlo_costs(scanned)["kernels"]
