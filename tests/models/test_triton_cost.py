"""models/triton_cost.py: the matmuls inside a Triton kernel, read from the IR in the compiled
program's custom call, are each dot's 2 M N K times its loops' trip counts and the grid's
programs, at the precision the kernel asks for; the roofline and FLOPs of `aot.hlo_costs`
count them."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from models import aot
from models import config as config_lib
from models import triton_cost
from models.layers import flash_attention
from models.layers import gdn_fused
from models.layers import moe_fused

CHUNKS, HEADS, C, D = 4, 2, 64, 128


def _compiled(fn, *shapes) -> str:
  """`fn` compiled for one H200 from this CPU (XLA:GPU's Triton pipeline): the HLO text."""
  device = aot.target_devices("h200:1x1")[0]
  args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=SingleDeviceSharding(device))
          for s in shapes]
  with config_lib.compiling_for("gpu"):
    return jax.jit(fn).lower(*args).compile().as_text()


def _kernel_dots(text: str) -> list:
  return [triton_cost.dots(line) for line in text.splitlines() if triton_cost.TARGET in line]


@pytest.mark.parametrize("precision, expected", [("highest", "tf32x3"), ("high", "tf32")])
def test_a_kernels_dots_are_2mnk_times_its_programs_at_the_precision_it_asks(precision,
                                                                             expected):
  """The chunk-output kernel (`gdn_fused.chunk_outputs`), forward: a program per (row x head,
  chunk, block of OUTPUT_BLOCK_V columns) with q k^T [c, d_k] x [d_k, c], (q e^G) S
  [c, d_k] x [d_k, block] and A v_new [c, c] x [c, block]."""
  shape = (CHUNKS, 1, HEADS, C, D)
  text = _compiled(lambda q, k, g, s, v: gdn_fused.chunk_outputs(q, k, g, s, v, precision),
                   shape, shape, shape[:4], (CHUNKS, 1, HEADS, D, D), shape)
  (dots,) = _kernel_dots(text)
  block = gdn_fused.OUTPUT_BLOCK_V
  programs = HEADS * CHUNKS * (D // block)
  assert sorted(f for f, _, _ in dots) == sorted(
      2.0 * programs * x for x in (C * D * C, C * D * block, C * C * block))
  assert {(dtype, p) for _, dtype, p in dots} == {("f32", expected)}


def test_a_loops_dots_count_its_trip_count_times():
  """The walk (`gdn_fused.walk`), forward: its `fori_loop` over the chunks holds two dots a
  step, w S [c, d_k] x [d_k, block] and k^T v_new [d_k, c] x [c, block]; a program per (row x
  head, block of BLOCK_V columns). The roofline prices them at three TF32 passes."""
  shape = (CHUNKS, 1, HEADS, C, D)
  text = _compiled(lambda u, w, k, a, s0: gdn_fused.walk(u, w, k, a, s0),
                   shape, shape, shape, shape[:3], (1, HEADS, D, D))
  (dots,) = _kernel_dots(text)
  block = gdn_fused.BLOCK_V
  each = 2.0 * HEADS * (D // block) * CHUNKS * C * D * block
  assert [f for f, _, _ in dots] == [each, each]
  spec = aot.DEVICES["h200"]
  costs = aot.hlo_costs(text, spec=spec)
  assert costs["flops"] == 2 * each
  tf32x3 = spec.tf32_flops / 3
  assert costs["roofline_seconds"] >= 2 * each / tf32x3


def test_a_loop_whose_length_follows_the_program_counts_each_programs_own_trips():
  """Causal flash attention (`flash_attention.causal`, JAX's kernel), forward: the program of
  query block i loops over key blocks 0 .. ceil(BLOCK_Q (i + 1) / BLOCK_K) - 1, the bound a
  function of its program id, with two dots a step (q k^T [bq, d] x [d, bk], p v [bq, bk] x
  [bk, d]). Each program's trips, summed over the grid, not one trip a program."""
  b, t, heads, d = 1, 512, 2, 64
  bq, bk = flash_attention.BLOCK_Q, flash_attention.BLOCK_K
  device = aot.target_devices("h200:1x1")[0]
  args = [jax.ShapeDtypeStruct((b, t, heads, d), jnp.bfloat16,
                               sharding=SingleDeviceSharding(device)) for _ in range(3)]
  with config_lib.compiling_for("gpu"):
    text = jax.jit(flash_attention.causal).lower(*args).compile().as_text()
  (dots,) = _kernel_dots(text)
  trips = sum(-(-bq * (i + 1) // bk) for i in range(t // bq)) * b * heads
  assert [f for f, _, _ in dots] == [2.0 * bq * d * bk * trips] * 2


def _triton_launches(text: str):
  """(parsed module, each Triton custom call of its entry computation)."""
  m = aot._parsed(text)
  return m, [i for i in m.comps[m.entry] if i.op == "custom-call"
             and aot._call_target(i) == triton_cost.TARGET]


def test_a_kernel_reading_one_layers_experts_of_a_stack_moves_those_not_the_stack():
  """The expert matmul of a decode step (`moe_fused.block_matmul`) handed every layer's stacked
  experts [layers, experts, d_in, d_out] and the layer's index, two blocks of one row: the
  kernel reads the two matrices its blocks name, so its traffic counts those, not the 4 x 8
  matrices of the stack (the roofline's bytes read from the kernel's loads)."""
  layers, experts, d_in, d_out = 4, 8, 64, 128
  device = aot.target_devices("h200:1x1")[0]
  one = SingleDeviceSharding(device)
  xs = jax.ShapeDtypeStruct((2, 1, d_in), jnp.bfloat16, sharding=one)
  w = jax.ShapeDtypeStruct((layers, experts, d_in, d_out), jnp.bfloat16, sharding=one)
  ids = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=one)
  with config_lib.compiling_for("gpu"):
    text = jax.jit(lambda xs, w, ids: moe_fused.block_matmul(xs, w, ids, layer=2)).lower(
        xs, w, ids).compile().as_text()
  m, (call,) = _triton_launches(text)
  matrix = d_in * d_out * 2
  moved = triton_cost.arg_bytes(call.rest)
  assert moved[(4, "load")] == 2 * matrix          # w: the kernel's fifth argument
  small = 4 + 2 * 4 + 4 + 2 * d_in * 2 + 2 * d_out * 2   # layer, ids, used, xs; the result
  assert aot.kernel_traffic(call, m.comps, m.nbytes) == small + 2 * matrix
  whole = sum(m.nbytes[o] for o in aot._operand_names(call.rest))
  assert whole >= layers * experts * matrix     # what the operands' sizes alone would count


def test_a_tile_a_kernel_loads_again_counts_once():
  """Causal flash attention's forward loads each key and value block once per query block at
  or after it (its loads move more than the keys hold); the roofline counts each operand at
  most whole (the cache holds what a launch reads again), as before the loads were read."""
  b, t, heads, d = 1, 512, 2, 64
  device = aot.target_devices("h200:1x1")[0]
  args = [jax.ShapeDtypeStruct((b, t, heads, d), jnp.bfloat16,
                               sharding=SingleDeviceSharding(device)) for _ in range(3)]
  with config_lib.compiling_for("gpu"):
    text = jax.jit(flash_attention.causal).lower(*args).compile().as_text()
  m, (call,) = _triton_launches(text)
  operands = [m.nbytes[o] for o in aot._operand_names(call.rest)]
  moved = triton_cost.arg_bytes(call.rest)
  assert max(moved.get((i, "load"), 0) for i in range(len(operands))) > max(operands)
  results = aot._bytes(aot._arrays(call.type_str))
  assert aot.kernel_traffic(call, m.comps, m.nbytes) == sum(operands) + results
