"""Ahead-of-time compilation for accelerators this machine does not have, and what it reports.

    devices = aot.target_devices("v5p:2x2x4")      # 16 compile-only TPU v5p chips
    devices = aot.target_devices("h200:2x8")       # 2 hosts x 8 compile-only H200s
    mesh = sharding.make_mesh(config.mesh, devices)
    compiled = jax.jit(f, in_shardings=...).lower(*abstract_args).compile()
    report = aot.analyse(compiled, aot.target_spec("v5p:2x2x4"))

XLA compiles for a device description rather than a device: the TPU compiler (the `libtpu`
wheel) takes a topology name, XLA:GPU (the CUDA plugin) a GpuTargetConfig text proto
(`models/gpu_targets/*.txtpb`, written from public spec sheets). The compile-only devices have
no memory; a program lowered for them is compiled exactly as it would be on the slice, so its
`memory_analysis()` is the compiler's per-device budget of the real run.

What `analyse` reports, per device:
  memory      argument, output, aliased (donated) and temporary bytes; the total the program
              holds is arguments + outputs - aliased + temporaries (+ TPU program code).
  flops       counted from the optimized HLO: every dot / convolution (and cuBLAS GEMM custom
              call, and matmul inside a Triton kernel) times the trip counts of the while
              loops around it. XLA's own
              `cost_analysis()` counts a loop body once (the layer scan, the micro-batch loop),
              which undercounts a training step by the product of those trip counts; on GPU it
              returns nothing at all.
  collectives count and bytes of each kind (all-gather, reduce-scatter, all-reduce,
              all-to-all, collective-permute), the result shapes' bytes times trip counts;
              given each device's host, also the bytes of those whose device groups span
              hosts (on a GPU cluster the slow links: InfiniBand between nodes, NVLink within).
  custom_calls the custom-call targets with their counts (cuDNN attention, cuBLAS GEMMs, ...).
  kernels     (GPU) the kernels a run of the program launches: the ops outside fusions that
              XLA:GPU runs as one kernel each (fusions, custom calls, copies, scatters, sorts,
              collectives, conditionals), times the trip counts of the loops around them; a
              loop's condition is left out. A count of launches, not of time: it says where a
              small-batch step is launch-bound (docs/results.md, "One H200").
  host_syncs  (GPU) the times a run stops the host until the device has caught up: XLA:GPU
              copies each `conditional`'s predicate to the host and waits for it, and so each
              test of a while loop whose trip count XLA has not written down
              (`known_trip_count`); times the loops around them. Between two such waits the
              host cannot queue work ahead of the device (the next step, or CUDA graphs'
              launches). A loop of unknown trip count counts two tests.
  traffic_bytes (GPU sense) the HBM bytes its kernels read and write: each launch's operands
              and results, or only the slices a fusion takes of an operand and the update it
              writes in place, or the parts of its operands a Triton kernel's loads read and
              of its results its stores write (read from the kernel's IR, `triton_cost`);
              times the trip counts. Collectives are left out (links).
  roofline_seconds each kernel at the slower of its dots' FLOPs at the device's matmul peak for
              their dtype and precision (`DeviceSpec.matmul_flops`: a float32 dot at
              `highest` runs on a GPU's CUDA cores, 1/15 of the bfloat16 peak) and its bytes
              at the HBM bandwidth, summed: an estimate, a floor for a GPU. It leaves out the
              gaps between launches (a few microseconds each where the host launches them)
              and overlap, and counts a cuBLAS or cuDNN call's operands whole
              (`kernel_traffic`).
              A Triton kernel's matmuls, which the HLO does not show, are read from the
              kernel's own IR (`triton_cost`; at the precision it asks Triton for), and
              count in `flops` too.
              `kernel_lines` splits it by the source lines the kernels came from.
  optimal_seconds (TPU only) XLA's roofline estimate of the step, scaled by the trip counts its
              cost analysis leaves out (the ratio of counted FLOPs to its FLOPs): an estimate.

Trip counts are read from each loop's condition (`compare(counter, constant N), direction=LT`,
as every `lax.scan` / `fori_loop` lowers: counter from 0, step 1). A loop whose condition has
another form counts once, and `analyse` lists it under `unknown_trip_counts`.
Conditionals (`lax.cond`) count every branch once: an upper bound, which for the train step's
skipped micro-batches and empty updates is the computed case.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import re
import sys
import time
from typing import Any, Optional

import numpy as np
from jax._src import xla_bridge  # the registry of topology factories: no public accessor
from jax.experimental import topologies

from models import triton_cost

GiB = 1024 ** 3
_GPU_TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
# Where `make setup-compile` installs the CUDA plugin: beside the project's packages, not among
# them, because an installed CUDA plugin writes its "no CUDA driver" lines to stderr at every
# `import jax` of every process on a machine without a GPU. Only a GPU compile loads it.
GPU_COMPILER_DIR = os.environ.get(
    "GPU_COMPILER_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "gpu-compiler"))


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """Public figures of one device (what jax counts as one): HBM, dense bfloat16 peak and HBM
  bandwidth. `devices_per_chip`: devices a chip of a TPU target's grid shows (2 on TPU7x,
  whose two TensorCores are a device each; the figures are then a chip's halves)."""
  name: str
  platform: str            # "tpu" | "cuda"
  hbm_bytes: int
  peak_bf16_flops: float   # per second, dense
  hbm_bytes_per_s: float
  devices_per_chip: int = 1
  f32_flops: float = 0.0    # GPU: true float32 (CUDA cores), per second; 0 = not listed
  tf32_flops: float = 0.0   # GPU: TF32 tensor cores, dense

  def matmul_flops(self, dtype: str, precision: str = "default") -> float:
    """Peak matmul FLOP/s for operands of HLO `dtype` at a dot's `precision` (default | high
    | highest, or a Triton dot's ieee | tf32 | tf32x3): 16- and 8-bit at the bfloat16 peak;
    float32 on a GPU TF32 unless `highest` / `ieee` (true float32), a third of it at
    `tf32x3` (three passes); on a TPU 1, 3 or 6 bfloat16 passes."""
    if dtype not in ("f32", "f64"):
      return self.peak_bf16_flops
    if self.platform == "tpu":
      return self.peak_bf16_flops / {"highest": 6, "high": 3}.get(precision, 1)
    if precision in ("highest", "ieee"):
      return self.f32_flops or self.peak_bf16_flops
    return (self.tf32_flops or self.peak_bf16_flops) / (3 if precision == "tf32x3" else 1)


# Spec sheets (per device). TPU: Cloud TPU system architecture pages (a TPU7x chip: 192 GiB,
# 2307 TFLOP/s, 7.37 TB/s over its two TensorCores); GPU: NVIDIA's data sheets (H100 SXM 80 GB,
# H200 SXM 141 GB, A100 SXM4 80 GB, HGX B200 (an eighth of its 8 GPUs' figures); dense, no
# sparsity: bfloat16, then FP32 and TF32 tensor cores; a GPU's memory is what its driver
# reports, as models/gpu_targets/<kind>.txtpb has it).
DEVICES = {
    "v4": DeviceSpec("TPU v4", "tpu", 32 * GiB, 275e12, 1.2e12),
    "v5e": DeviceSpec("TPU v5e", "tpu", 16 * GiB, 197e12, 819e9),
    "v5p": DeviceSpec("TPU v5p", "tpu", 95 * GiB, 459e12, 2.765e12),
    "v6e": DeviceSpec("TPU v6e", "tpu", 32 * GiB, 918e12, 1.64e12),
    "tpu7x": DeviceSpec("TPU7x TensorCore", "tpu", 96 * GiB, 1153.5e12, 3.685e12, 2),
    "h100": DeviceSpec("NVIDIA H100 SXM", "cuda", 80 * GiB, 989e12, 3.35e12, 1, 67e12, 494.5e12),
    "h200": DeviceSpec("NVIDIA H200 SXM", "cuda", 141 * GiB, 989e12, 4.8e12, 1, 67e12, 494.5e12),
    "a100": DeviceSpec("NVIDIA A100 SXM4 80GB", "cuda", 85_100_068_864, 312e12, 2.039e12, 1,
                       19.5e12, 156e12),
    "b200": DeviceSpec("NVIDIA B200", "cuda", 191_514_411_008, 2250e12, 8.0e12, 1, 75e12,
                       1125e12),
}


@dataclasses.dataclass(frozen=True)
class Target:
  """A parsed target: `kind:shape`, e.g. v5p:4x4x4 (TPU chips) or h200:2x8 (hosts x GPUs)."""
  kind: str
  shape: tuple
  spec: DeviceSpec

  @property
  def num_devices(self) -> int:
    """Devices of the target: GPUs (hosts x GPUs a host), or a TPU grid's chips x devices a chip."""
    return math.prod(self.shape) * self.spec.devices_per_chip

  def __str__(self) -> str:
    return f"{self.kind}:{'x'.join(map(str, self.shape))}"


def parse_target(target: str) -> Target:
  """'v5p:2x2x4' / 'h200:2x8' -> Target; a clear error for anything else."""
  kind, sep, shape = str(target).strip().lower().partition(":")
  if not sep or kind not in DEVICES:
    raise ValueError(f"compile target {target!r}: expected KIND:SHAPE with KIND one of "
                     f"{sorted(DEVICES)}, e.g. v5p:2x2x4 (TPU chips) or h200:2x8 (hosts x GPUs)")
  try:
    dims = tuple(int(d) for d in shape.split("x"))
  except ValueError:
    dims = ()
  spec = DEVICES[kind]
  want = 2 if spec.platform == "cuda" else (2, 3)
  if not dims or any(d < 1 for d in dims) or len(dims) not in (
      (want,) if isinstance(want, int) else want):
    form = "HOSTSxGPUS (e.g. 2x8)" if spec.platform == "cuda" else "a chip grid (e.g. 4x4x4)"
    raise ValueError(f"compile target {target!r}: shape {shape!r} is not {form}")
  return Target(kind, dims, spec)


def gpu_target_config(kind: str) -> str:
  """The GpuTargetConfig text proto of GPU `kind` (models/gpu_targets/<kind>.txtpb)."""
  path = os.path.join(_GPU_TARGET_DIR, f"{kind}.txtpb")
  with open(path, encoding="utf-8") as f:
    return f.read()


@functools.lru_cache(maxsize=None)
def target_devices(target: str) -> list:
  """Compile-only devices of `target` (nothing runs on them; programs compile for them).

  TPU needs the `libtpu` wheel and GPU the CUDA plugin (requirements-compile.txt, `make
  setup-compile`); a missing one is an error that says so. Several processes may hold libtpu
  at once here (ALLOW_MULTIPLE_LIBTPU_LOAD): nothing runs on a device, so nothing is shared.
  """
  t = parse_target(target)
  try:
    if t.spec.platform == "tpu":
      os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
      # libtpu's names: v5p and v6e chips by their generation ("v5p:2x2x4"), v5e as "v5e".
      topo = topologies.get_topology_desc(topology_name=f"{t.kind}:{'x'.join(map(str, t.shape))}",
                                          platform="tpu")
    else:
      _load_cuda_plugin()
      hosts, per_host = t.shape
      # XLA:GPU's topology string is slices x hosts x devices a host.
      topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(t.kind),
                                          topology=f"1x{hosts}x{per_host}")
  except Exception as e:  # the plugin's own errors are long and say nothing of the install
    what = "libtpu" if t.spec.platform == "tpu" else "the CUDA plugin (jax-cuda12-plugin)"
    raise RuntimeError(f"cannot compile for {target}: {what} failed to describe the target "
                       f"({type(e).__name__}: {str(e).splitlines()[0][:300]}); install it with "
                       f"`make setup-compile`") from e
  devices = list(topo.devices)
  if len(devices) != t.num_devices:
    raise RuntimeError(f"target {target}: expected {t.num_devices} devices, got {len(devices)}")
  return devices


def _load_cuda_plugin() -> None:
  """Registers the CUDA plugin from GPU_COMPILER_DIR (once; jax may have started already)."""
  if xla_bridge._topology_factories.get("cuda"):  # pylint: disable=protected-access
    return
  if os.path.isdir(GPU_COMPILER_DIR) and GPU_COMPILER_DIR not in sys.path:
    sys.path.append(GPU_COMPILER_DIR)
  try:
    plugin = importlib.import_module("jax_plugins.xla_cuda12")
  except ImportError as e:
    raise RuntimeError(f"the CUDA plugin is not installed (looked in {GPU_COMPILER_DIR})") from e
  # Compiling needs no CUDA runtime: the plugin's check of the installed CUDA libraries would
  # refuse to load without them unless JAX_PLATFORMS already leaves CUDA out.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  _use_pinned_ptxas()
  plugin.initialize()


def _use_pinned_ptxas() -> None:
  """Points XLA:GPU at the pinned nvidia-cuda-nvcc-cu12 (ptxas, libdevice) beside the plugin.

  Without it XLA looks for a CUDA toolkit (/usr/local/cuda, PATH) and, on a machine without
  one, fails with "libdevice not found". The plugin reads XLA_FLAGS when it starts (its own
  copy of XLA), so this goes before `initialize`; a user's own `--xla_gpu_cuda_data_dir` wins.
  """
  nvcc = os.path.join(GPU_COMPILER_DIR, "nvidia", "cuda_nvcc")
  flags = os.environ.get("XLA_FLAGS", "")
  if os.path.isfile(os.path.join(nvcc, "bin", "ptxas")) and "xla_gpu_cuda_data_dir" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_cuda_data_dir={nvcc}".strip()


# ------------------------------------------------------------------------------ HLO analysis

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# Ops XLA:GPU launches as a kernel of their own where they stand outside a fusion (`kernels`).
_KERNEL_OPS = frozenset(("fusion", "custom-call", "copy", "scatter", "sort", "conditional")
                        + COLLECTIVES + tuple(c + "-start" for c in COLLECTIVES))
_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_COMP_START = re.compile(r"^(ENTRY )?%?([^\s(]+) \(.*\) -> .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_OPERAND = re.compile(r"%([^\s,()]+)")


def _arrays(type_str: str) -> list[tuple[str, tuple]]:
  """(dtype, dims) of each array in an HLO type string (a tuple type lists several)."""
  out = []
  for dt, dims in _ARRAY.findall(type_str):
    if dt in _DTYPE_BYTES:
      out.append((dt, tuple(int(d) for d in dims.split(",") if d)))
  return out


def _bytes(arrays) -> int:
  return sum(_DTYPE_BYTES[dt] * math.prod(d) for dt, d in arrays)


@dataclasses.dataclass
class _Instr:
  name: str
  type_str: str
  op: str
  rest: str


def _parse_module(text: str) -> tuple[dict, Optional[str]]:
  """HLO text -> ({computation: [instructions]}, entry computation name)."""
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    m = _COMP_START.match(line)
    if m:
      cur = m.group(2)
      comps[cur] = []
      if m.group(1):
        entry = cur
      continue
    if cur is None:
      continue
    if line.startswith("}"):
      cur = None
      continue
    m = _INSTR.match(line)
    if m:
      comps[cur].append(_Instr(*m.groups()))
  return comps, entry


def _dims_attr(rest: str, name: str) -> tuple:
  m = re.search(name + r"=\{([0-9,]*)\}", rest)
  return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def _operand_names(rest: str) -> list[str]:
  """Operand names of an instruction (the text inside its call parentheses)."""
  depth, end = 1, len(rest)
  for i, ch in enumerate(rest):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      end = i
      break
  return _OPERAND.findall(rest[:end])


def _dot_flops(instr: _Instr, shapes: dict) -> float:
  out = _arrays(instr.type_str)
  ops = _operand_names(instr.rest)
  if not out or not ops or ops[0] not in shapes:
    return 0.0
  lhs = shapes[ops[0]]
  contract = math.prod(lhs[d] for d in _dims_attr(instr.rest, "lhs_contracting_dims"))
  return 2.0 * math.prod(out[0][1]) * contract


def _conv_flops(instr: _Instr, shapes: dict) -> float:
  """2 x output elements x input features x the window taps that meet real input.

  XLA:TPU writes dots as convolutions: `dim_labels=bf_io->bf` for a matmul, and batch
  dimensions as spatial ones of a base-dilated window (`window={size=8x4 lhs_dilate=8x4}`),
  where of each window only size / lhs_dilate taps (here one) meet an input element; the rest
  meet the dilation's zeros and are no work."""
  out = _arrays(instr.type_str)
  ops = _operand_names(instr.rest)
  m = re.search(r"dim_labels=[^_]+_([^-]+)->", instr.rest)
  if not out or len(ops) < 2 or ops[1] not in shapes or not m:
    return 0.0
  kernel, labels = shapes[ops[1]], m.group(1)
  if len(labels) != len(kernel) or "i" not in labels:
    return 0.0
  taps = 1
  w = re.search(r"window=\{([^}]*)\}", instr.rest)
  if w:
    attrs = dict(kv.split("=", 1) for kv in w.group(1).split() if "=" in kv)
    size = [int(x) for x in attrs.get("size", "").split("x") if x]
    dilate = [int(x) for x in attrs.get("lhs_dilate", "").split("x") if x] or [1] * len(size)
    taps = math.prod(-(-s // d) for s, d in zip(size, dilate))
  return 2.0 * math.prod(out[0][1]) * kernel[labels.index("i")] * taps


def _gemm_call_flops(instr: _Instr, shapes: dict) -> float:
  """cuBLAS GEMM custom calls (`__cublas$gemm`, `__cublas$lt$matmul`): dimension numbers live
  in the backend config."""
  m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.rest)
  ops = _operand_names(instr.rest)
  out = _arrays(instr.type_str)
  if not m or not ops or ops[0] not in shapes or not out:
    return 0.0
  lhs = shapes[ops[0]]
  contract = math.prod(lhs[int(d.strip('" '))] for d in m.group(1).split(",") if d.strip())
  return 2.0 * math.prod(out[0][1]) * contract


def _trip_count(cond: list[_Instr], comps: dict) -> Optional[int]:
  """N of a loop condition `counter < N` (constant N), or None for another form. The compare
  may sit in a fusion the condition calls, with the constant passed in as an operand."""
  consts = {}
  for ins in cond:
    if ins.op == "constant":
      m = re.match(r"(-?\d+)\)", ins.rest)
      if m:
        consts[ins.name] = int(m.group(1))
  for ins in cond:
    is_lt = ins.op == "compare" and "direction=LT" in ins.rest
    if ins.op == "fusion":
      callee = re.search(r"calls=%?([^\s,}]+)", ins.rest)
      body = comps.get(callee.group(1), []) if callee else []
      is_lt = any(i.op == "compare" and "direction=LT" in i.rest for i in body)
      inner = _trip_count(body, comps) if is_lt else None
      if inner is not None:
        return inner
    if is_lt:
      for name in _operand_names(ins.rest)[1:]:
        if name in consts:
          return consts[name]
  return None


def _callees(instr: _Instr) -> list[tuple[str, str]]:
  """(role, computation) pairs an instruction calls."""
  out = []
  for role in ("calls", "to_apply", "body", "condition", "true_computation",
               "false_computation"):
    for m in re.finditer(role + r"=%?([^\s,}]+)", instr.rest):
      out.append((role, m.group(1)))
  m = re.search(r"branch_computations=\{([^}]*)\}", instr.rest)
  if m:
    out += [("branch", n.strip().lstrip("%")) for n in m.group(1).split(",") if n.strip()]
  return out


_GROUP_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUP_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_GROUP_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\]"
                         r"(?:T\(([0-9,]+)\))?\))? \{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _ints(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v]


def _iota(dims: list[int], perm: Optional[str]) -> np.ndarray:
  """The iota of shape `dims` transposed by `perm` (XLA's `[dims]T(perm)`)."""
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose(_ints(perm)) if perm else ids


def device_groups(rest: str) -> Optional[list[list[int]]]:
  """The device groups of a collective's attributes (positions in the program's device
  assignment): its `replica_groups` in any of XLA's three forms (a list, an iota, a mesh and
  its axes) or a permute's `source_target_pairs`; [] = all devices; None = none found."""
  m = _GROUP_LIST.search(rest)
  if m:
    return [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
  m = _PAIRS.search(rest)
  if m:
    return [_ints(g) for g in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
  m = _GROUP_IOTA.search(rest)
  if m:
    return _iota(_ints(m.group(3)), m.group(4)).reshape(-1, int(m.group(2))).tolist()
  m = _GROUP_MESH.search(rest)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    dims = [int(n) for _, n in axes]
    ids = (_iota(_ints(m.group(2)), m.group(3)) if m.group(2) else
           np.arange(math.prod(dims))).reshape(dims)
    grouped = {a.strip().strip("'") for a in m.group(4).split(",")}
    # The mesh's other axes pick a group, its grouped axes run within it (both row-major).
    within = [i for i, (a, _) in enumerate(axes) if a in grouped]
    across = [i for i, (a, _) in enumerate(axes) if a not in grouped]
    size = math.prod(dims[i] for i in within)
    return ids.transpose(across + within).reshape(-1, size).tolist()
  return None


def _between_hosts(rest: str, hosts) -> bool:
  """Whether a collective's groups put devices of different hosts together."""
  groups = device_groups(rest)
  if groups is None or groups == [] or groups == [[]]:
    return len(set(hosts)) > 1
  return any(len({hosts[d] for d in g}) > 1 for g in groups)


# Ops inside a fusion that read only part of their first operand (what they return), and ops
# that write part of a buffer in place (the index of the operand written: nothing else of the
# buffer is read or written).
_SLICING = frozenset(("dynamic-slice", "slice", "gather"))
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}
# Kernels costed by their bytes and FLOPs (`kernel_traffic`): launches that touch memory.
_COSTED_OPS = frozenset(("fusion", "custom-call", "copy", "scatter", "sort"))


def _uses(name: str, users: dict) -> list[tuple[_Instr, int]]:
  """(instruction, operand position) of each use of `name`, looking through bitcasts."""
  out = []
  for ins, pos in users.get(name, []):
    out += _uses(ins.name, users) if ins.op == "bitcast" else [(ins, pos)]
  return out


def _fusion_traffic(ins: _Instr, body: list[_Instr], nbytes: dict) -> int:
  """HBM bytes a fusion reads and writes: each operand whole, or only the slices its body
  takes of it (dynamic-slice, slice, gather), nothing of a buffer it updates in place; each
  result whole, or only the update of an in-place dynamic-update-slice / scatter root."""
  by_name = {i.name: i for i in body}
  users, params = {}, {}
  for i in body:
    if i.op == "parameter":
      params[int(re.match(r"(\d+)\)", i.rest).group(1))] = i.name
    for pos, name in enumerate(_operand_names(i.rest) if i.op != "parameter" else []):
      users.setdefault(name, []).append((i, pos))
  read = 0
  for idx, operand in enumerate(_operand_names(ins.rest)):
    full = nbytes.get(operand, 0)
    uses = _uses(params.get(idx, ""), users)
    if uses and all(pos == 0 and (u.op in _SLICING or u.op in _IN_PLACE) for u, pos in uses):
      full = min(full, sum(_bytes(_arrays(u.type_str)) for u, _ in uses if u.op in _SLICING))
    read += full
  root = body[-1] if body else None
  roots = [by_name[n] for n in _operand_names(root.rest) if n in by_name] \
      if root is not None and root.op == "tuple" else [root]
  write = 0
  for r in roots:
    while r is not None and r.op == "bitcast":
      r = by_name.get((_operand_names(r.rest) or [""])[0])
    if r is None:
      continue
    if r.op in _IN_PLACE:
      updated = _operand_names(r.rest)
      write += nbytes.get(updated[_IN_PLACE[r.op]], 0) if len(updated) > _IN_PLACE[r.op] else 0
    else:
      write += _bytes(_arrays(r.type_str))
  return read + write


def kernel_traffic(ins: _Instr, comps: dict, nbytes: dict) -> int:
  """HBM bytes one launch of a kernel reads and writes (a roofline's memory side): fusions
  as `_fusion_traffic`; a Triton kernel as `_triton_traffic`; another custom call (cuBLAS,
  cuDNN) its operands and results, less the scratch (u8 / s8) buffers its result tuple
  carries, whole; a copy or sort its operands and results; a scatter its updates twice (read,
  written in place) and its indices. Collectives and conditionals: 0 (links and the host, not
  HBM)."""
  operands = _operand_names(ins.rest)
  if ins.op == "fusion":
    callee = dict(_callees(ins)).get("calls", "")
    return _fusion_traffic(ins, comps.get(callee, []), nbytes)
  if ins.op == "scatter":
    return 2 * nbytes.get(operands[-1], 0) + sum(nbytes.get(o, 0) for o in operands[1:-1])
  if ins.op in ("custom-call", "copy", "sort"):
    out = [a for a in _arrays(ins.type_str) if a[0] not in ("u8", "s8")] or _arrays(ins.type_str)
    whole = [nbytes.get(o, 0) for o in operands], [_bytes([a]) for a in out]
    if ins.op == "custom-call" and _call_target(ins) == triton_cost.TARGET:
      return _triton_traffic(ins, *whole)
    return sum(whole[0]) + sum(whole[1])
  return 0


def _triton_traffic(ins: _Instr, operand_bytes: list, result_bytes: list) -> int:
  """HBM bytes of one launch of a Triton kernel: of each operand, what its loads read (read
  from the kernel's IR, `triton_cost.arg_bytes`) up to the operand's size, and of each result
  what its stores write up to the result's size. So a kernel that reads part of an operand
  (the decode kernels handed every layer's stacked states and the layer's index, the expert
  matmul reading only its blocks' experts) counts that part, and one that reads a tile again
  (flash attention's keys, once a query block) counts it once: the cache is taken to hold
  what a launch reads twice. Loads of a result (a kernel reading back what it wrote) are left
  out. Where the IR does not say (no IR, an access not traced to an argument, a count of
  arguments that is not the operands' and results'), operands and results whole."""
  moved = triton_cost.arg_bytes(ins.rest)
  n = len(operand_bytes)
  if moved is None or max((arg for arg, _ in moved), default=-1) >= n + len(result_bytes):
    return sum(operand_bytes) + sum(result_bytes)
  read = sum(min(b, moved.get((i, "load"), 0)) for i, b in enumerate(operand_bytes))
  write = sum(min(b, moved.get((n + j, "store"), 0)) for j, b in enumerate(result_bytes))
  return int(read + write)


def _loop_trips(ins: _Instr, comps: dict, unknown: list) -> int:
  """A while loop's trip count: XLA's `known_trip_count`, else read from its condition
  (`_trip_count`); 1 and the condition added to `unknown` when neither says."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.rest)   # XLA's own, where it says
  if m:
    return int(m.group(1))
  cond_name = dict(_callees(ins))["condition"]
  n = _trip_count(comps.get(cond_name, []), comps)
  if n is None:
    unknown.append(cond_name)
    return 1
  return n


@dataclasses.dataclass(frozen=True)
class _Module:
  """A parsed optimized HLO module: its text, {computation: [instructions]}, the entry, and per
  instruction name its first array's dims and dtype and the bytes of all its arrays."""
  text: str
  comps: dict
  entry: str
  shapes: dict
  dtypes: dict
  nbytes: dict


def _parsed(text: str) -> _Module:
  comps, entry = _parse_module(text)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  shapes, dtypes, nbytes = {}, {}, {}
  for instrs in comps.values():
    for ins in instrs:
      arrays = _arrays(ins.type_str)
      if arrays:
        dtypes[ins.name], shapes[ins.name] = arrays[0]
        nbytes[ins.name] = _bytes(arrays)
  return _Module(text, comps, entry, shapes, dtypes, nbytes)


def _call_target(ins: _Instr) -> str:
  m = re.search(r'custom_call_target="([^"]+)"', ins.rest)
  return m.group(1) if m else "?"


def _own_flops(ins: _Instr, m: _Module, spec: Optional[DeviceSpec]):
  """(FLOPs, seconds at `spec`'s matmul peak for the operands' dtype and the dot's precision;
  0 without a spec) of an instruction itself: dots, convolutions, cuBLAS GEMM calls, and the
  matmuls inside Triton kernels (`triton_cost`: read from the kernel's IR)."""
  if ins.op == "custom-call" and _call_target(ins) == triton_cost.TARGET:
    found = triton_cost.dots(ins.rest)
    flops = sum(f for f, _, _ in found)
    if spec is None:
      return flops, 0.0
    return flops, sum(f / spec.matmul_flops(dtype, prec) for f, dtype, prec in found)
  if ins.op == "dot":
    flops = _dot_flops(ins, m.shapes)
  elif ins.op == "convolution":
    flops = _conv_flops(ins, m.shapes)
  elif ins.op == "custom-call" and "cublas" in _call_target(ins):
    flops = _gemm_call_flops(ins, m.shapes)
  else:
    return 0.0, 0.0
  if spec is None or not flops:
    return flops, 0.0
  prec = re.search(r'operand_precision(?:=\{|":\[")(\w+)', ins.rest)
  lhs = (_operand_names(ins.rest) or [""])[0]
  rate = spec.matmul_flops(m.dtypes.get(lhs, "bf16"),
                           prec.group(1).lower() if prec else "default")
  return flops, flops / rate


@dataclasses.dataclass
class _Cost:
  """What a computation costs a run, its loops unrolled (`hlo_costs`)."""
  flops: float = 0.0
  matmul_s: float = 0.0                 # its dots' FLOPs at the matmul peak of their dtype
  collectives: dict = dataclasses.field(default_factory=dict)   # kind -> (count, bytes, between)
  calls: dict = dataclasses.field(default_factory=dict)
  kernels: int = 0
  syncs: int = 0
  traffic: int = 0
  roofline_s: float = 0.0

  def add(self, other: "_Cost", times: int, launches: bool, timed: bool = True) -> None:
    """Adds `times` runs of a computation this one calls; `launches`: its kernels run as
    kernels of their own (not inside a fusion, not a loop's test); `timed`: its traffic and
    roofline time count (not a conditional's branch that is not the costliest)."""
    self.flops += times * other.flops
    self.matmul_s += times * other.matmul_s
    if launches:
      self.kernels += times * other.kernels
      self.syncs += times * other.syncs
    if launches and timed:
      self.traffic += times * other.traffic
      self.roofline_s += times * other.roofline_s
    for kind, (cn, cb, cx) in other.collectives.items():
      n0, b0, x0 = self.collectives.get(kind, (0, 0, 0))
      self.collectives[kind] = (n0 + times * cn, b0 + times * cb, x0 + times * cx)
    for target, cnt in other.calls.items():
      self.calls[target] = self.calls.get(target, 0) + times * cnt


_BRANCH_ROLES = ("branch", "true_computation", "false_computation")


def _callee_runs(ins: _Instr, n_trip: int) -> list[tuple[str, str, int]]:
  """(role, computation, runs) of each computation `ins` calls, a while loop's `n_trip` times
  (its condition once more); the scalar reducers of reduce / all-reduce / scatter left out."""
  return [(role, callee, n_trip + 1 if role == "condition" else (n_trip if role == "body" else 1))
          for role, callee in _callees(ins) if role != "to_apply" or ins.op == "call"]


def _costing(m: _Module, hosts, spec: Optional[DeviceSpec], unknown: list):
  """The memoised cost of each computation of a parsed module (`hlo_costs`): computation name
  -> `_Cost`. A conditional's branches each count once in FLOPs, kernels, syncs and
  collectives (an upper bound), and only its costliest branch in traffic and roofline time:
  a run takes one (the train step's skip of a filtered micro-batch copies zeros, its other
  branch is the micro-batch's whole forward and backward)."""
  bw = spec.hbm_bytes_per_s if spec else math.inf

  @functools.lru_cache(maxsize=None)
  def cost(name: str) -> _Cost:
    c = _Cost()
    for ins in m.comps.get(name, []):
      c.kernels += ins.op in _KERNEL_OPS
      c.syncs += ins.op == "conditional"
      flops, secs = _own_flops(ins, m, spec)
      c.flops += flops
      c.matmul_s += secs
      if ins.op == "custom-call":
        c.calls[_call_target(ins)] = c.calls.get(_call_target(ins), 0) + 1
      kind = ins.op[:-6] if ins.op.endswith("-start") else ins.op
      if kind in COLLECTIVES:
        _add_collective(c.collectives, kind, ins, hosts)
      if ins.op in _COSTED_OPS:
        _, k_secs, k_bytes = _launch_cost(ins, (flops, secs), cost, m)
        c.traffic += k_bytes
        c.roofline_s += max(k_secs, k_bytes / bw)
      n_trip = _loop_trips(ins, m.comps, unknown) if ins.op == "while" else 1
      if ins.op == "while" and '"known_trip_count"' not in ins.rest:
        c.syncs += n_trip + 1       # XLA:GPU reads each test's predicate on the host
      taken = _costliest_branch(_callees(ins), cost)
      for role, callee, times in _callee_runs(ins, n_trip):
        # A fusion's body is its one kernel; a loop's test is not counted as launches.
        c.add(cost(callee), times, launches=ins.op != "fusion" and role != "condition",
              timed=role not in _BRANCH_ROLES or callee == taken)
    return c

  return cost


def _launch_cost(ins: _Instr, own: tuple, cost, m: _Module) -> tuple:
  """(FLOPs, matmul seconds, HBM bytes) of one launch of kernel `ins`, whose own (FLOPs,
  matmul seconds) are `own`: a fusion adds its body's (`cost`, `_costing`'s)."""
  k_flops, k_secs = own
  if ins.op == "fusion":
    body = cost(dict(_callees(ins))["calls"])
    k_flops, k_secs = k_flops + body.flops, k_secs + body.matmul_s
  return k_flops, k_secs, kernel_traffic(ins, m.comps, m.nbytes)


def _costliest_branch(callees: list, cost) -> Optional[str]:
  """The branch of a conditional (its callees) with the most roofline time, then traffic."""
  branches = [callee for role, callee in callees if role in _BRANCH_ROLES]
  return max(branches, key=lambda b: (cost(b).roofline_s, cost(b).traffic), default=None)


def hlo_costs(text: str, hosts=None, spec: Optional[DeviceSpec] = None,
              top_lines: int = 0) -> dict:
  """FLOPs, collectives, custom calls, kernels, host syncs and HBM traffic of an optimized HLO
  module, loops unrolled by their trip counts (see the module docstring). `hosts`: the host of
  each device of the program's device assignment, in its order; each collective kind then also
  gives the bytes of the collectives whose groups span hosts (`between_hosts`). `spec`: adds
  `roofline_seconds`, each kernel at the slower of its dots' FLOPs at the device's matmul peak
  for their dtype and precision and its bytes at its HBM bandwidth, summed (an estimate: no
  launch gaps, no overlap); with `top_lines`, also
  `kernel_lines`, that time's costliest source lines (`kernel_lines`), from the same parse."""
  m = _parsed(text)
  unknown = []
  cost = _costing(m, hosts, spec, unknown)
  c = cost(m.entry)
  lines = {"kernel_lines": _kernel_rows(m, cost, spec, top_lines)} if spec and top_lines else {}
  return {**lines, "flops": c.flops, "kernels": int(c.kernels), "host_syncs": int(c.syncs),
          "traffic_bytes": int(c.traffic),
          **({"roofline_seconds": c.roofline_s} if spec else {}),
          "collectives": {k: {"count": int(n), "bytes": int(b),
                              **({"between_hosts": int(x)} if hosts is not None else {})}
                          for k, (n, b, x) in sorted(c.collectives.items())},
          "custom_calls": dict(sorted(c.calls.items())),
          "unknown_trip_counts": sorted(set(unknown))}


def _add_collective(coll: dict, kind: str, ins: _Instr, hosts) -> None:
  """Adds one collective's count and bytes (and bytes between hosts) to `coll[kind]`."""
  arrays = _arrays(ins.type_str)
  # An async start's result is (operands..., results...): its largest array is the result of
  # an all-gather and the operand of a reduce-scatter; either is the bytes moved.
  nbytes = max((_bytes([a]) for a in arrays), default=0) if ins.op.endswith("-start") \
      else _bytes(arrays)
  n, b, x = coll.get(kind, (0, 0, 0))
  coll[kind] = (n + 1, b + nbytes,
                x + (nbytes if hosts is not None and _between_hosts(ins.rest, hosts) else 0))


_FRAME_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _stack_frames(text: str) -> dict[int, list[str]]:
  """stack_frame_id -> its frames, innermost first ("file:line function"), from the tables
  an optimized module's text begins with (a frame's `parent_frame_id` is 1 + its parent's
  index; 0: none)."""
  tables, cur = {t: {} for t in _FRAME_TABLES}, None
  for line in text.splitlines():
    if line.strip() in _FRAME_TABLES:
      cur = line.strip()
      continue
    m = re.match(r"^(\d+) (.*)$", line)
    if cur is None or not m:
      if line.startswith(("%", "ENTRY")):
        break
      continue
    tables[cur][int(m.group(1))] = m.group(2)
  names = {k: v.strip('"') for k, v in tables["FileNames"].items()}
  funcs = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
  where = {}
  for k, v in tables["FileLocations"].items():
    f = dict(re.findall(r"(\w+)=(\d+)", v))
    path = names.get(int(f.get("file_name_id", 0)), "?")
    path = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    where[k] = f"{path}:{f.get('line', '?')} {funcs.get(int(f.get('function_name_id', 0)), '?')}"
  parents = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in tables["StackFrames"].items()}
  out = {}
  for k in parents:
    chain, f = [], k
    while f in parents and len(chain) < 64:
      here = where.get(int(parents[f]["file_location_id"]), "?")
      if not chain or chain[-1] != here:     # a loop's body and its call share a line
        chain.append(here)
      f = int(parents[f]["parent_frame_id"]) - 1
    out[k] = chain
  return out


def _executions(m: _Module, cost, unknown: list) -> dict[str, int]:
  """Launches a run makes of each kernel instruction (`_COSTED_OPS` outside fusions' bodies):
  1 times the trip counts of the loops around it; of a conditional, the costliest branch's
  (`_costing`'s `cost`)."""
  out: dict[str, int] = {}

  def walk(name: str, times: int) -> None:
    for ins in m.comps.get(name, []):
      if ins.op in _COSTED_OPS:
        out[ins.name] = out.get(ins.name, 0) + times
      if ins.op == "fusion":
        continue
      n_trip = _loop_trips(ins, m.comps, unknown) if ins.op == "while" else 1
      taken = _costliest_branch(_callees(ins), cost)
      for role, callee, runs in _callee_runs(ins, n_trip):
        if role == "condition" or (role in _BRANCH_ROLES and callee != taken):
          continue   # loop tests (scalars); the branches a run does not take
        walk(callee, times * runs)

  walk(m.entry, 1)
  return out


def kernel_lines(text: str, spec: DeviceSpec, top: int = 20, depth: int = 2) -> list[dict]:
  """Where a program's kernels would spend a device's time, by source line (an estimate):
  each kernel launch costed as `hlo_costs`' roofline (the slower of its dots at the matmul
  peak and its bytes at HBM bandwidth), grouped by the `depth` innermost frames of the code it
  came from, the `top` largest first: {"where", "seconds", "launches", "flops", "bytes"}."""
  m = _parsed(text)
  return _kernel_rows(m, _costing(m, None, spec, []), spec, top, depth)


def _kernel_rows(m: _Module, cost, spec: DeviceSpec, top: int, depth: int = 2) -> list[dict]:
  """`kernel_lines` of a parsed module and its `_costing`."""
  frames = _stack_frames(m.text)
  by_name = {i.name: i for instrs in m.comps.values() for i in instrs}
  rows: dict[str, dict] = {}
  for name, times in _executions(m, cost, []).items():
    ins = by_name[name]
    frame = re.search(r"stack_frame_id=(\d+)", ins.rest)
    if frame is None and ins.op == "copy":     # XLA's own copies: named by what they copy
      source = by_name.get((_operand_names(ins.rest) or [""])[0])
      frame = source and re.search(r"stack_frame_id=(\d+)", source.rest)
    where = " < ".join(frames.get(int(frame.group(1)), [])[:depth]) if frame else ""
    k_flops, k_secs, k_bytes = _launch_cost(ins, _own_flops(ins, m, spec), cost, m)
    row = rows.setdefault(where or f"({ins.op}, no source)",
                          {"seconds": 0.0, "launches": 0, "flops": 0.0, "bytes": 0})
    row["seconds"] += times * max(k_secs, k_bytes / spec.hbm_bytes_per_s)
    row["launches"] += times
    row["flops"] += times * k_flops
    row["bytes"] += times * k_bytes
  ranked = sorted(rows.items(), key=lambda kv: -kv[1]["seconds"])[:top]
  return [{"where": w, **r} for w, r in ranked]


def memory(compiled) -> dict:
  """Per-device bytes of a compiled program: arguments, outputs, aliased, temporaries, code."""
  m = compiled.memory_analysis()
  out = {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
         "alias": int(m.alias_size_in_bytes), "temp": int(m.temp_size_in_bytes),
         "code": int(getattr(m, "generated_code_size_in_bytes", 0) or 0)}
  out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["code"]
  return out


_OOM = (re.compile(r"Used ([0-9.]+)([KMGT])? of ([0-9.]+)([KMGT])? (?:hbm|memory)", re.I),
        re.compile(r"HLO temporaries \(([0-9.]+)([KMGT])?\) exceeds available HBM \(([0-9.]+)([KMGT])?\)",
                   re.I))
_UNIT = {None: 1, "": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def compile_lowered(lowered, attempts: int = 3, wait_s: float = 10.0):
  """`lowered.compile()`, tried again when XLA:GPU could not start `ptxas`.

  XLA:GPU runs ptxas as child processes to assemble a program's kernels; on a machine short of
  processes or memory for a moment, starting one fails ("Failed to launch ptxas") where the next
  try starts it. Any other error, or the same one `attempts` times, is raised.
  """
  for attempt in range(1, attempts):
    try:
      return lowered.compile()
    except Exception as e:  # pylint: disable=broad-except
      if "Failed to launch ptxas" not in str(e):
        raise
      print(f"XLA:GPU could not start ptxas (try {attempt} of {attempts}); compiling again in "
            f"{wait_s:.0f} s", file=sys.stderr, flush=True)
      time.sleep(wait_s)
  return lowered.compile()


def out_of_memory(error: BaseException) -> Optional[dict]:
  """{"needed": bytes, "available": bytes} when a compile failed for want of device memory."""
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
    return None
  m = _OOM[0].search(text) or _OOM[1].search(text)
  if not m:
    return {"needed": None, "available": None, "message": text.splitlines()[0][:300]}
  need = float(m.group(1)) * _UNIT[(m.group(2) or "").upper()]
  have = float(m.group(3)) * _UNIT[(m.group(4) or "").upper()]
  return {"needed": int(need), "available": int(have), "message": text.splitlines()[0][:300]}


def analyse(compiled, spec: DeviceSpec, hosts=None, top_lines: int = 0) -> dict:
  """Memory, counted FLOPs, collectives and (TPU) XLA's time estimate of a compiled program;
  `hosts` and `top_lines` as `hlo_costs` takes them."""
  mem = memory(compiled)
  costs = hlo_costs(compiled.as_text(), hosts, spec, top_lines)
  out = {"memory": mem, "fits": mem["total"] <= spec.hbm_bytes, "hbm_bytes": spec.hbm_bytes,
         **costs}
  ca = None
  try:
    ca = compiled.cost_analysis()
  except Exception:  # XLA:GPU raises or returns None without a device: nothing to report
    ca = None
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else None
  if ca and ca.get("optimal_seconds", -1) > 0 and ca.get("flops"):
    # XLA's estimate counts each loop body once; scale it by the trip counts it leaves out.
    out["xla_optimal_seconds"] = float(ca["optimal_seconds"])
    out["estimated_seconds"] = float(ca["optimal_seconds"]) * costs["flops"] / float(ca["flops"])
  return out


def describe(devices: list[Any]) -> str:
  d = devices[0]
  return f"{len(devices)} x {getattr(d, 'device_kind', d.platform)}"
