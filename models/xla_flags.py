"""XLA:CPU's matmul library for the training steps (`train.xla_cpu_dots`), as compiler options.

XLA:CPU hands each dot to one of two libraries. By default every single dot that YNNPACK
supports goes to YNNPACK (and reductions too); without that, dots run through Eigen's
contraction on the intra-op thread pool. On the 2-core CPU the project is measured on, YNNPACK
runs a *batched* matmul on one core: the blocked MoE's expert matmuls ([blocks, 128, 128] x
[blocks, 128, 128] at the tiny default) take 3.3 ms there against 2.3 ms in Eigen (1.5 ms for a
flat matmul of the same FLOPs), and the whole forward+backward step ran 1.18x / 1.15x
transformers' (two benchmark shapes) in Eigen. The small matmuls of a decode step do not gain:
the engine's decode at 32 sequences read 7119 tokens/s with Eigen against 8607 with YNNPACK
(docs/results.md, "Model step and decode"). So the choice is made per program, not per process:

  "eigen"    dots through Eigen: the default of the training steps (RL and SFT) and of
             benchmarks/model_step.py (a dot that XLA fuses into a reduction YNNPACK takes
             stays there);
  "ynnpack"  XLA's own default; what every other program (decode, scoring) compiles with.

Both give the same result within float32 rounding (the order of each dot's sums differs):
tests/models/test_xla_flags.py checks the model's logits and gradients both ways. The options
concern the CPU backend alone; on GPU and TPU `compiler_options` returns none.
"""
import re

import jax

CPU_DOTS = ("eigen", "ynnpack")
# The option is the list of op kinds XLA:CPU sends to YNNPACK; its default is single dots and
# reductions. Eigen's choice keeps the reductions and leaves the dots out.
_OPTIONS = {"eigen": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"},
            "ynnpack": {}}


def compiler_options(choice: str, backend: str | None = None) -> dict:
  """`jax.jit(..., compiler_options=...)` for `choice` on `backend` (the default backend)."""
  if choice not in CPU_DOTS:
    raise ValueError(f"xla_cpu_dots={choice!r}: expected one of {', '.join(CPU_DOTS)}")
  backend = jax.default_backend() if backend is None else backend
  return dict(_OPTIONS[choice]) if backend == "cpu" else {}


def ynnpack_dots(hlo_text: str) -> int:
  """How many dots of a compiled program (`compiled.as_text()`) YNNPACK runs on their own: the
  kind this option moves (a dot XLA fused into a YNNPACK reduction is not counted)."""
  bodies = dict(re.findall(r"^%?(\S+) \([^\n]*\{\n(.*?)^\}", hlo_text, re.M | re.S))
  called = re.findall(r"calls=%?([\w.\-]+).*\"kind\":\"__ynn_fusion\"", hlo_text)
  return sum(bool(re.search(r"^\s*ROOT [^\n]* dot\(", bodies.get(name, ""), re.M))
             for name in called)
