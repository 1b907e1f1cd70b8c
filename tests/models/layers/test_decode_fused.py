"""model.decode_attention=fused: a decode step's attention over the KV cache as one Pallas kernel
gives the XLA blocks' values, on one device, on a mesh and in the whole model, and compiles for
an H200 to one Triton kernel with no loop over the cache's blocks and no block copied."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from configs import base
from models import aot
from models import config as config_lib
from models import sharding
from models.layers import attention
from models.layers import decode_fused
from tests.models import kernel_checks

TRITON = "__gpu$xla.gpu.triton"


def _inputs(dtype, layers=3, rows=6, max_len=300, kv=2, heads=8, head_dim=32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  normal = lambda k, shape: jax.random.normal(k, shape).astype(dtype)
  cache = {"k": normal(ks[0], (layers, rows, max_len, kv, head_dim)),
           "v": normal(ks[1], (layers, rows, max_len, kv, head_dim))}
  new = {"k": normal(ks[2], (rows, kv, head_dim)), "v": normal(ks[3], (rows, kv, head_dim))}
  return normal(ks[4], (rows, heads, head_dim)), cache, new


# Rows with nothing cached, one position, exactly one block (128 at head_dim 32), a part of a
# block, all but one position and the whole cache (300: not a multiple of the block).
POS = jnp.asarray([0, 1, 128, 200, 299, 300], jnp.int32)


@pytest.mark.parametrize("programs", [decode_fused.TARGET_PROGRAMS, 1],
                         ids=["many splits", "one split"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-3)])
def test_the_fused_decode_gives_the_xla_blocks_values(monkeypatch, programs, dtype, tol):
  """Each layer of a stacked cache and an unstacked one, every row at its own length; with one
  split a program walks all three blocks of its row, with many each block is a program's."""
  monkeypatch.setattr(decode_fused, "TARGET_PROGRAMS", programs)
  q, cache, new = _inputs(dtype)
  fused = jax.jit(decode_fused.attend)
  for layer in (0, 2):
    want, _ = attention._attend_cached(q, cache, new, POS, jnp.int32(layer), block=64)
    got = fused(q, cache, new, POS, jnp.int32(layer))
    np.testing.assert_allclose(got, want, atol=tol * float(jnp.abs(want).max()))
  one = {n: c[1] for n, c in cache.items()}
  want, _ = attention._attend_cached(q, one, new, POS, block=64)
  np.testing.assert_allclose(jax.jit(decode_fused.attend)(q, one, new, POS), want,
                             atol=tol * float(jnp.abs(want).max()))


def test_the_fused_decode_on_a_mesh_equals_one_device():
  """On 8 CPU devices, rows split 4 ways and kv heads 2 ways (`jax.shard_map`: XLA does not
  partition a Pallas kernel), the values are one device's."""
  q, cache, new = _inputs(jnp.float32, rows=4, heads=8)
  pos = jnp.asarray([3, 300, 0, 130], jnp.int32)
  one = jax.jit(decode_fused.attend)(q, cache, new, pos, jnp.int32(1))
  mesh, rules, place = kernel_checks.mesh_2x2x1x2()
  with sharding.use_mesh(mesh, rules):
    kv_axes = ("layers", "batch", "activation_length", "kv_heads", "head_dim")
    placed = (place(q, ("batch", "activation_heads", None)),
              {n: place(x, kv_axes) for n, x in cache.items()},
              {n: place(x, ("batch", "kv_heads", None)) for n, x in new.items()},
              place(pos, ("batch",)))
    assert placed[1]["k"].sharding.shard_shape(cache["k"].shape)[1:4:2] == (1, 1)
    on_mesh = jax.jit(decode_fused.attend)(*placed, jnp.int32(1))
  np.testing.assert_allclose(on_mesh, one, atol=1e-6)


def test_a_model_decodes_with_the_fused_kernel_as_with_xla():
  """Prefill then eight decode steps of the whole model: the same logits either way."""
  runs = kernel_checks.decode_each_way("decode_attention", config_lib.DECODE_ATTENTIONS)
  for a, b in zip(runs["fused"][0], runs["xla"][0]):
    np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("devices", [1, 2])
def test_the_fused_decode_compiles_for_an_h200_to_one_triton_kernel(devices):
  """Compiled for H200s from this CPU, a stacked 160k-position cache: one Triton kernel, no loop
  (the XLA form is a loop over 2,048-position blocks, each copied out of the cache by a dynamic
  slice) and no slice; on two GPUs, rows split, the same per device."""
  targets = aot.target_devices(f"h200:1x{devices}")
  layers, rows, max_len, kv, hd = 10, 4, 160000, 2, 256
  mesh_cfg = base.get_config().mesh
  mesh_cfg.shape = (devices, 1, 1, 1)
  mesh = sharding.make_mesh(mesh_cfg, targets)
  rules = sharding.rules_from_config(mesh_cfg.rules)
  with config_lib.compiling_for("gpu"), sharding.use_mesh(mesh, rules):
    spec = lambda *axes: NamedSharding(mesh, sharding.logical_to_spec(axes, rules, mesh))
    shape = lambda s, *axes: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=spec(*axes))
    kv_cache = shape((layers, rows, max_len, kv, hd), None, "batch")
    args = (shape((rows, 16, hd), "batch"), {"k": kv_cache, "v": kv_cache},
            {"k": shape((rows, kv, hd), "batch"), "v": shape((rows, kv, hd), "batch")},
            jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=spec("batch")),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=spec()))
    hlo = jax.jit(decode_fused.attend).lower(*args).compile().as_text()
  assert hlo.count(f'custom_call_target="{TRITON}"') == 1
  assert " while(" not in hlo and "dynamic-slice" not in hlo


def test_fused_decode_errors_name_the_setting():
  """On TPU (no kernel), for a head width Triton cannot tile, and for a cache split along its
  positions (a row's blocks must be on one device)."""
  q, cache, new = _inputs(jnp.float32, head_dim=24)
  with config_lib.compiling_for("tpu"), pytest.raises(ValueError, match="decode_attention=fused"):
    decode_fused.attend(q, cache, new, POS, 0)
  with config_lib.compiling_for("gpu"), pytest.raises(ValueError, match="head_dim"):
    decode_fused.attend(q, cache, new, POS, 0)
  q, cache, new = _inputs(jnp.float32, rows=2, max_len=64)
  c = base.get_config()
  c.mesh.shape = (1, 8, 1, 1)
  rules = sharding.rules_from_config((("batch", None), ("activation_length", "fsdp")) + tuple(c.mesh.rules))
  with sharding.use_mesh(sharding.make_mesh(c.mesh), rules), pytest.raises(
      ValueError, match="positions are split"):
    decode_fused.attend(q, cache, new, POS[:2], 0)
