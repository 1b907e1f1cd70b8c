"""models/aot.py: targets, compile-only devices and what is read from a compiled program."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models import aot


def test_targets_parse_and_bad_ones_say_what_is_expected():
  t = aot.parse_target("v5p:2x2x4")
  assert (t.kind, t.shape, t.num_devices, t.spec.platform) == ("v5p", (2, 2, 4), 16, "tpu")
  g = aot.parse_target("H200:2x8")
  assert (g.kind, g.num_devices, g.spec.hbm_bytes) == ("h200", 16, 141 * aot.GiB)
  x = aot.parse_target("tpu7x:2x2x1")     # 4 chips, each two TensorCores: 8 devices
  assert (x.num_devices, x.spec.hbm_bytes) == (8, 96 * aot.GiB)
  for bad, words in (("v9:2x2", "KIND one of"), ("h200:16", "HOSTSxGPUS"), ("v5p", "KIND:SHAPE"),
                     ("v5p:2xa", "chip grid")):
    with pytest.raises(ValueError, match=words):
      aot.parse_target(bad)


def _matmul_chain(n: int, unroll: bool):
  """n matmuls of [64, 128] x [128, 128], in a scan or written out."""
  def f(x, ws):
    if unroll:
      for i in range(n):
        x = jnp.tanh(x @ ws[i])
      return x
    return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]
  return f


@pytest.mark.parametrize("target", ["cpu", "v5p:2x2x1"])
def test_flops_count_each_loop_iteration_and_match_the_unrolled_program(target):
  """XLA's cost analysis counts a loop body once; the HLO count multiplies by the trip count:
  a scan of 12 matmuls counts what the same 12 written out count, and both are the analytic
  2 x m x k x n x 12 (on TPU too, where dots are convolutions)."""
  n = 12
  x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  ws = jax.ShapeDtypeStruct((n, 128, 128), jnp.float32)
  if target != "cpu":
    dev = aot.target_devices(target)[0]
    one = jax.sharding.SingleDeviceSharding(dev)
    x, ws = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one) for a in (x, ws))
  counts = {}
  for unroll in (False, True):
    compiled = jax.jit(_matmul_chain(n, unroll)).lower(x, ws).compile()
    counts[unroll] = aot.hlo_costs(compiled.as_text())
  analytic = 2 * 64 * 128 * 128 * n
  assert counts[False]["flops"] == counts[True]["flops"] == analytic
  assert counts[False]["unknown_trip_counts"] == []


_LOOP_HLO = """HloModule m

%fused_body (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} copy(%p)
}

%cond (s: (s32[], f32[8])) -> pred[] {
  %s = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] fusion(%i, %n), kind=kLoop, calls=%fused_body
}

%body (s: (s32[], f32[8])) -> (s32[], f32[8]) {
  %s = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%s), index=1
  %a = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_body
  %b = f32[8]{0} custom-call(%a), custom_call_target="__cublas$gemm"
  %c = f32[8]{0} fusion(%b), kind=kLoop, calls=%fused_body
  %i = s32[] get-tuple-element(%s), index=0
  ROOT %t = (s32[], f32[8]) tuple(%i, %c)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %y = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_body
  %z = s32[] constant(0)
  %t = (s32[], f32[8]) tuple(%z, %y)
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_kernels_are_the_unfused_ops_times_their_loops_trip_counts():
  """A fusion outside the loop and three kernels a step (two fusions, a GEMM) over 5 steps:
  16 launches; the ops inside a fusion's body and the loop's condition are not launches."""
  assert aot.hlo_costs(_LOOP_HLO)["kernels"] == 1 + 5 * 3


_SYNC_HLO = """HloModule m

%branch (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} copy(%p)
}

%cond (s: (s32[], f32[8])) -> pred[] {
  %s = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (s: (s32[], f32[8])) -> (s32[], f32[8]) {
  %s = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%s), index=1
  %i = s32[] get-tuple-element(%s), index=0
  %z = s32[] constant(0)
  %q = pred[] compare(%i, %z), direction=EQ
  %y = f32[8]{0} conditional(%q, %x, %x), true_computation=%branch, false_computation=%branch
  ROOT %t = (s32[], f32[8]) tuple(%i, %y)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[8]) tuple(%z, %x)
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %v = (s32[], f32[8]) while(%w), condition=%cond, body=%body
  ROOT %r = f32[8]{0} get-tuple-element(%v), index=1
}
"""


def test_host_syncs_are_each_conditional_and_each_test_of_a_loop_xla_did_not_count():
  """A conditional in two loops of 4 steps: 8 syncs; the loop without XLA's known_trip_count
  also reads its predicate on the host at each of its 5 tests: 13."""
  assert aot.hlo_costs(_SYNC_HLO)["host_syncs"] == 4 + (4 + 5)


# Instruction names are unique in a module, as XLA prints them (the analysis keys on them).
_TRAFFIC_HLO = """HloModule m

%fused_update (p0: bf16[4,128,512], p1: f32[128,512], p2: s32[]) -> bf16[4,128,512] {
  %p0 = bf16[4,128,512]{2,1,0} parameter(0)
  %p1 = f32[128,512]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %old = bf16[1,128,512]{2,1,0} dynamic-slice(%p0, %p2, %z, %z), dynamic_slice_sizes={1,128,512}
  %t = f32[128,512]{1,0} tanh(%p1)
  %c = bf16[128,512]{1,0} convert(%t)
  %n = bf16[1,128,512]{2,1,0} bitcast(%c)
  %u = bf16[1,128,512]{2,1,0} add(%n, %old)
  ROOT %d = bf16[4,128,512]{2,1,0} dynamic-update-slice(%p0, %u, %p2, %z, %z)
}

%gemm_bf16 (a1: bf16[1024,1024], b1: bf16[1024,1024]) -> f32[1024,1024] {
  %a1 = bf16[1024,1024]{1,0} parameter(0)
  %b1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %dot1 = f32[1024,1024]{1,0} dot(%a1, %b1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm_f32 (a2: f32[1024,1024], b2: f32[1024,1024]) -> f32[1024,1024] {
  %a2 = f32[1024,1024]{1,0} parameter(0)
  %b2 = f32[1024,1024]{1,0} parameter(1)
  ROOT %dot2 = f32[1024,1024]{1,0} dot(%a2, %b2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, operand_precision={highest,highest}
}

ENTRY %main (buf: bf16[4,128,512], x: f32[128,512], i: s32[], a: bf16[1024,1024], b: f32[1024,1024]) -> (bf16[4,128,512], f32[1024,1024], f32[1024,1024]) {
  %buf = bf16[4,128,512]{2,1,0} parameter(0)
  %x = f32[128,512]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %a = bf16[1024,1024]{1,0} parameter(3)
  %b = f32[1024,1024]{1,0} parameter(4)
  %upd = bf16[4,128,512]{2,1,0} fusion(%buf, %x, %i), kind=kLoop, calls=%fused_update
  %mm = f32[1024,1024]{1,0} fusion(%a, %a), kind=kCustom, calls=%gemm_bf16
  %mm32 = f32[1024,1024]{1,0} fusion(%b, %b), kind=kCustom, calls=%gemm_f32
  ROOT %r = (bf16[4,128,512]{2,1,0}, f32[1024,1024]{1,0}, f32[1024,1024]{1,0}) tuple(%upd, %mm, %mm32)
}
"""


def test_a_kernel_moves_the_slices_it_reads_and_the_update_it_writes_in_place_not_its_buffer():
  """The update of one [128, 512] row of a [4, 128, 512] buffer reads that row (bf16), the new
  values (f32) and writes the row back: not the buffer, which XLA updates in place."""
  m = aot._parsed(_TRAFFIC_HLO)
  upd = next(i for i in m.comps["main"] if i.name == "upd")
  row = 128 * 512
  assert aot.kernel_traffic(upd, m.comps, m.nbytes) == row * 2 + row * 4 + 4 + row * 2


def test_the_roofline_is_each_kernel_at_the_slower_of_its_matmuls_at_their_dtypes_peak_and_its_bytes():
  """A bf16 GEMM of 1024^3 on an H200: 2.1 GFLOP at 989 TFLOP/s (2.2 us) against 8 MiB at 4.8
  TB/s (1.7 us): compute-bound. The same GEMM in float32 at `highest` runs on CUDA cores (67
  TFLOP/s: 32 us). The in-place update is memory-bound."""
  spec = aot.DEVICES["h200"]
  r = aot.hlo_costs(_TRAFFIC_HLO, spec=spec)
  flops = 2 * 1024 ** 3
  update = (128 * 512 * 8 + 4) / spec.hbm_bytes_per_s
  assert r["roofline_seconds"] == pytest.approx(flops / 989e12 + flops / 67e12 + update)
  assert r["traffic_bytes"] == 128 * 512 * 8 + 4 + 1024 * 1024 * (2 * 2 + 4) + 1024 * 1024 * 12
  assert spec.matmul_flops("f32", "default") == 494.5e12      # TF32 tensor cores
  assert aot.DEVICES["v5p"].matmul_flops("f32", "highest") == 459e12 / 6   # six bf16 passes


_BRANCH_HLO = """HloModule m

%small (p: f32[1024]) -> f32[8] {
  %p = f32[1024]{0} parameter(0)
  %s = f32[8]{0} slice(%p), slice={[0:8]}
  ROOT %c = f32[8]{0} copy(%s)
}

%large (q: f32[1024]) -> f32[8] {
  %q = f32[1024]{0} parameter(0)
  %e = f32[1024]{0} exponential(%q)
  %x = f32[1024]{0} copy(%e)
  ROOT %t = f32[8]{0} slice(%x), slice={[0:8]}
}

ENTRY %main (pred: pred[], v: f32[1024]) -> f32[8] {
  %pred = pred[] parameter(0)
  %v = f32[1024]{0} parameter(1)
  ROOT %r = f32[8]{0} conditional(%pred, %v, %v), true_computation=%small, false_computation=%large
}
"""


def test_a_conditional_costs_its_costliest_branch_in_traffic_and_time_and_every_branch_in_kernels():
  """A run takes one branch: the traffic is the larger branch's copy (4 KiB read and written),
  not both; the kernel count stays an upper bound over both branches."""
  r = aot.hlo_costs(_BRANCH_HLO, spec=aot.DEVICES["h200"])
  assert r["traffic_bytes"] == 2 * 1024 * 4
  assert r["kernels"] == 1 + 1 + 1      # the conditional and a copy in each branch


def test_kernel_lines_put_each_loops_kernels_on_the_source_line_they_came_from():
  """A scan of 4 matmuls: the matmul's line takes the loop's launches, their FLOPs and nearly
  all the time, and its caller is named after it."""
  def f(w, x):
    def body(c, xi):
      y = jnp.tanh(xi @ w)                       # the matmul's line
      return c + y.sum(), y
    return jax.lax.scan(body, 0.0, x)

  text = jax.jit(f).lower(jnp.ones((256, 512)), jnp.ones((4, 128, 256))).compile().as_text()
  rows = aot.kernel_lines(text, aot.DEVICES["h200"])
  top = max(rows, key=lambda r: r["flops"])
  line = f.__code__.co_firstlineno + 2
  assert top["where"].startswith(f"{os.path.relpath(__file__)}:{line} ")
  assert " < " in top["where"] and top["flops"] == 4 * 2 * 128 * 256 * 512
  assert top["launches"] % 4 == 0


_COPY_HLO = """HloModule m

FileNames
1 "models/layers/x.py"

FunctionNames
1 "zeros"

FileLocations
1 {file_name_id=1 function_name_id=1 line=7 end_line=7 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

%fill () -> f32[1024] {
  %z = f32[] constant(0)
  ROOT %b = f32[1024]{0} broadcast(%z), dimensions={}
}

ENTRY %main () -> f32[1024] {
  %zeros = f32[1024]{0} fusion(), kind=kLoop, calls=%fill, metadata={stack_frame_id=1}
  ROOT %c = f32[1024]{0} copy(%zeros)
}
"""


def test_kernel_lines_name_a_copy_xla_made_by_the_line_of_what_it_copies():
  """XLA's own copies carry no source; they are put on their operand's line."""
  rows = aot.kernel_lines(_COPY_HLO, aot.DEVICES["h200"])
  assert [r["where"] for r in rows] == ["models/layers/x.py:7 zeros"]
  assert rows[0]["launches"] == 2 and rows[0]["bytes"] == 1024 * 4 * 3


def test_collectives_are_counted_with_their_bytes_on_a_tpu_slice():
  devices = aot.target_devices("v5p:2x2x1")
  mesh = Mesh(np.array(devices), ("x",))
  a = jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
  # A sum over the sharded axis: each device reduces its rows, then an all-reduce of [256].
  compiled = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P())).lower(a).compile()
  coll = aot.hlo_costs(compiled.as_text())["collectives"]
  assert coll["all-reduce"]["count"] >= 1 and coll["all-reduce"]["bytes"] >= 256 * 4


def test_collective_device_groups_read_in_each_of_xlas_forms():
  """A list, an iota (transposed or not), a mesh with and without its own device order, and a
  permute's pairs: the same groups of 2 hosts x 8 devices."""
  by_host = [list(range(8)), list(range(8, 16))]
  across = [[i, i + 8] for i in range(8)]
  assert aot.device_groups("replica_groups={{0,8},{1,9},{2,10},{3,11},{4,12},{5,13},{6,14},"
                           "{7,15}}, dimensions={0}") == across
  assert aot.device_groups("replica_groups=[2,8]<=[16], dimensions={0}") == by_host
  assert aot.device_groups("replica_groups=[8,2]<=[2,8]T(1,0), dimensions={0}") == across
  assert aot.device_groups("replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_1'}, "
                           "dimensions={0}") == by_host
  assert aot.device_groups("replica_groups=mesh['axis_0'=1,'axis_1'=8,'axis_2'=2], "
                           "device_ids=([2,8]T(1,0)) {'axis_1'}") == by_host
  assert aot.device_groups("source_target_pairs={{0,1},{1,9}}") == [[0, 1], [1, 9]]
  assert aot.device_groups("replica_groups={}") == []


@pytest.mark.parametrize("split", ["host", "gpu"])
def test_collectives_between_hosts_are_those_whose_groups_span_hosts(split):
  """A sum over an axis split across the two hosts of h200:2x8 reduces between them; over the
  axis of each host's GPUs it stays within each host."""
  devices = aot.target_devices("h200:2x8")
  mesh = Mesh(np.array(devices).reshape(2, 8), ("host", "gpu"))
  a = jax.ShapeDtypeStruct((16, 1024), jnp.float32, sharding=NamedSharding(mesh, P(split)))
  compiled = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P())).lower(
      a).compile()
  coll = aot.hlo_costs(compiled.as_text(), [d.process_index for d in devices])["collectives"]
  moved = sum(v["bytes"] for v in coll.values())
  assert moved >= 1024 * 4
  assert sum(v["between_hosts"] for v in coll.values()) == (0 if split == "gpu" else moved)


def test_memory_report_has_its_fields_and_totals_them():
  compiled = jax.jit(lambda a: a @ a.T).lower(jax.ShapeDtypeStruct((256, 64), jnp.float32)).compile()
  r = aot.analyse(compiled, aot.DEVICES["h200"])
  m = r["memory"]
  assert set(m) == {"argument", "output", "alias", "temp", "code", "total"}
  assert m["argument"] == 256 * 64 * 4 and m["output"] == 256 * 256 * 4
  assert m["total"] == m["argument"] + m["output"] - m["alias"] + m["temp"] + m["code"]
  assert r["fits"] and r["flops"] == 2 * 256 * 64 * 256


def test_an_out_of_memory_compile_error_becomes_needed_and_available_bytes():
  err = RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in "
                     "memory space hbm. Used 111.23G of 95.74G hbm. Exceeded hbm capacity by 15.49G.")
  oom = aot.out_of_memory(err)
  assert oom["needed"] == int(111.23 * aot.GiB) and oom["available"] == int(95.74 * aot.GiB)
  assert aot.out_of_memory(ValueError("shapes do not match")) is None
  # XLA:TPU's other wording: the temporaries alone against what the arguments leave.
  oom = aot.out_of_memory(RuntimeError(
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
      "temporaries (114.15G) exceeds available HBM (95.74G)."))
  assert oom["needed"] == int(114.15 * aot.GiB) and oom["available"] == int(95.74 * aot.GiB)


def test_a_tpu7x_chip_is_two_devices_as_libtpu_describes_it():
  assert len(aot.target_devices("tpu7x:2x2x1")) == aot.parse_target("tpu7x:2x2x1").num_devices


def test_gpu_targets_are_hosts_of_gpus():
  """h200:2x8 is two hosts (processes) of eight GPUs each, as a per-process engine sees them."""
  devices = aot.target_devices("h200:2x8")
  assert len(devices) == 16
  assert [d.process_index for d in devices] == [0] * 8 + [1] * 8


def test_auto_settings_follow_the_platform_compiled_for():
  """Traced on this CPU for a TPU or a GPU, the per-backend "auto" choices are the target's:
  the compile mode must build what a run on those devices would (e.g. not the CPU's 128-query
  causal blocks, which unroll a 160k row into 1280 blocks)."""
  from configs import base
  from models import config as config_lib
  from models import qwen3_5
  from models.layers import attention, gated_deltanet
  m = base.get_model_config()
  m.update(dtype="bfloat16")
  cfg = qwen3_5.config_from_dict(m)
  here = (attention.resolve_impl(cfg), attention.causal_block(cfg), gated_deltanet.chunk_size(cfg))
  assert here == ("reference", attention.AUTO_CAUSAL_BLOCK, 32)
  with config_lib.compiling_for("tpu"):
    assert (attention.resolve_impl(cfg), attention.causal_block(cfg),
            gated_deltanet.chunk_size(cfg)) == ("xla", 0, 64)
  with config_lib.compiling_for("gpu"):
    assert attention.resolve_impl(cfg) == "cudnn"
  assert config_lib.platform() == "cpu"


@pytest.mark.parametrize("kind", sorted(k for k, s in aot.DEVICES.items() if s.platform == "cuda"))
def test_each_gpu_kind_has_a_target_config_the_compiler_accepts(kind):
  """Every GPU kind named in DEVICES has its GpuTargetConfig, whose memory is the spec's, and
  XLA:GPU compiles a sharded matmul for two of them (the figures a report divides by)."""
  spec = aot.DEVICES[kind]
  text = aot.gpu_target_config(kind)
  assert f"device_memory_size: {spec.hbm_bytes}\n" in text
  devices = aot.target_devices(f"{kind}:1x2")
  sh = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=sh)
  compiled = jax.jit(lambda a: (a @ a.T).sum()).lower(x).compile()
  assert aot.analyse(compiled, spec)["hbm_bytes"] == spec.hbm_bytes


_PINNED_PTXAS_PROBE = """
import os, sys, jax, jax.numpy as jnp
from models import aot
d = aot.target_devices("h200:1x1")[0]
sh = jax.sharding.SingleDeviceSharding(d)
x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16, sharding=sh)
if sys.argv[1:] == ["compile"]:
  jax.jit(lambda a: jnp.tanh(a @ a).sum()).lower(x).compile()
print(os.environ.get("XLA_FLAGS", ""))
"""


@pytest.mark.parametrize("own_dir", [None, "/opt/my-cuda"])
def test_gpu_compiles_assemble_with_the_pinned_ptxas_unless_the_user_names_a_cuda_dir(own_dir):
  """XLA:GPU assembles kernels with ptxas and links libdevice: the compile points it at the
  pinned nvidia-cuda-nvcc-cu12 beside the plugin (no CUDA toolkit needed on the machine), and a
  user's own --xla_gpu_cuda_data_dir is kept as given."""
  nvcc = os.path.join(aot.GPU_COMPILER_DIR, "nvidia", "cuda_nvcc")
  assert os.path.isfile(os.path.join(nvcc, "bin", "ptxas"))
  assert os.path.isfile(os.path.join(nvcc, "nvvm", "libdevice", "libdevice.10.bc"))
  flags = "--xla_force_host_platform_device_count=1"
  if own_dir:
    flags += f" --xla_gpu_cuda_data_dir={own_dir}"
  # A made-up CUDA dir is not compiled with; its case reads the flags only.
  args = ["compile"] if own_dir is None else []
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=root)
  out = subprocess.run([sys.executable, "-c", _PINNED_PTXAS_PROBE, *args], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  final_flags = out.stdout.strip().splitlines()[-1]
  want = own_dir or nvcc
  assert final_flags.count("xla_gpu_cuda_data_dir") == 1
  assert f"--xla_gpu_cuda_data_dir={want}" in final_flags


class _Lowered:
  """A lowered program whose compile fails as XLA:GPU does when ptxas cannot start, `fails`
  times, then compiles (an injected fault: the real one depends on the machine's load)."""

  def __init__(self, fails: int, message: str = "INTERNAL: Failed to launch ptxas"):
    self.fails, self.message, self.calls = fails, message, 0

  def compile(self):
    self.calls += 1
    if self.calls <= self.fails:
      raise jax.errors.JaxRuntimeError(self.message)
    return "compiled"


def test_a_compile_that_could_not_start_ptxas_is_tried_again_and_other_errors_are_not(capsys):
  lowered = _Lowered(fails=2)
  assert aot.compile_lowered(lowered, attempts=3, wait_s=0) == "compiled" and lowered.calls == 3
  assert "could not start ptxas (try 2 of 3)" in capsys.readouterr().err
  with pytest.raises(jax.errors.JaxRuntimeError, match="ptxas"):
    aot.compile_lowered(_Lowered(fails=3), attempts=3, wait_s=0)
  other = _Lowered(fails=1, message="RESOURCE_EXHAUSTED: out of memory")
  with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
    aot.compile_lowered(other, attempts=3, wait_s=0)
  assert other.calls == 1
