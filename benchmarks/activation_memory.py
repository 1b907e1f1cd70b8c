"""Where a training step's activation memory goes: the compiler's temporaries beside the plan's.

  python benchmarks/activation_memory.py                      # XLA:CPU and an H200 (compiled from here)
  python benchmarks/activation_memory.py --targets=cpu --remat=full --tokens=8192
  python benchmarks/activation_memory.py --size=smoke --targets=cpu --tokens=512 --seq=128
  python benchmarks/activation_memory.py --targets=h200 --parts=model --kept=false \
      --gdn_scan=fused --set=model.scan_unroll=0     # any model field: --set=model.KEY=VALUE

Compiles, for each target, the forward + backward of the accelerator benchmark's ~1B MoE
(benchmarks/accelerator.py `SIZES["1b"]`, bfloat16) over --tokens tokens in rows of --seq, and
prints the program's temporary bytes (`compiled.memory_analysis()`: what the step holds beyond
its inputs and outputs, i.e. activations and scratch) beside rl/plan.py's activation estimate for
the same tokens, and for a GPU the kernels a step launches and the roofline estimate of its time
with the MFU that allows (`aot.hlo_costs`; docs/accelerators.md). Then the same for
each part alone, over the same tokens: one attention layer, one Gated DeltaNet layer, one MoE
feed-forward, the LM head with the log-probabilities, an RMSNorm
- so a layer kind that holds far more than the plan counts shows by name, in bytes a token:

  peak  the temporaries of the part's forward + backward alone (what it keeps for its backward
        pass and its working set there: the recomputed Gated DeltaNet chunks, one attention
        block's scores, the LM head's float32 logits);
  kept  what one more such layer adds to a stack of them (a `lax.scan` over 3 layers less one
        over 2, as the model scans its layers): the bytes each layer keeps for the backward pass.

each beside the plan's figure for it (`plan.part_bytes`). A target is traced as a run on it
would be (models/config.compiling_for: the attention implementation and causal blocks, the
Gated DeltaNet chunk, the MoE dispatch of that platform); on a GPU, Pallas' flash attention
(`model.attention_impl=pallas`) stands in for cuDNN's, whose library compiling from here does
not install (as the compile mode does).

Nothing runs: every program is lowered for abstract inputs and compiled, for the CPU and for a
compile-only H200 (XLA:GPU, `make setup-compile`); no figure here is a measurement of a run. The
last line is JSON. About 5 minutes on a 2-core CPU for both targets (--kept=false: half).
"""
import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import accelerator  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])
import bench_overrides  # noqa: E402  (a sibling)
from models import aot  # noqa: E402
from models import config as config_lib  # noqa: E402
from models.config import GDN_SCANS  # noqa: E402
from models.config import MOE_DISPATCHES  # noqa: E402
from models import qwen3_5  # noqa: E402
from models.layers import attention  # noqa: E402
from models.layers import gated_deltanet  # noqa: E402
from models.layers import moe  # noqa: E402
from models.layers import norm  # noqa: E402
from rl import plan  # noqa: E402
from rl import train_step  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
PARTS = ("attention", "gated_deltanet", "moe", "lm_head_logprobs", "rms_norm")
LAYERS = ("attention", "gated_deltanet", "moe", "rms_norm")   # parts with a `kept` figure


def _place(tree, device):
  """ShapeDtypeStructs of `tree` on `device` (None: the default device)."""
  if device is None:
    return tree
  one = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), tree)


def _compile(fn, args, device):
  """jit(grad(fn)) compiled for `device` (None = this CPU; a GPU's ptxas that could not start
  is tried again, `aot.compile_lowered`)."""
  return aot.compile_lowered(jax.jit(jax.value_and_grad(fn)).lower(*_place(args, device)))


def temp_bytes(fn, args, device) -> int:
  """Temporary bytes of jit(grad(fn)) compiled for `device` (None = this CPU)."""
  return int(_compile(fn, args, device).memory_analysis().temp_size_in_bytes)


def layers(mc, rows: int, seq: int) -> dict:
  """name -> (param shapes, apply(params, x) -> [rows, seq, hidden]) of each layer part."""
  shapes = lambda f: jax.eval_shape(f, jax.random.key(0))
  positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq))
  return {
      "attention": (shapes(lambda k: attention.init(k, mc)),
                    lambda p, x: attention.forward(p, x, positions, mc)[0]),
      "gated_deltanet": (shapes(lambda k: gated_deltanet.init(k, mc)),
                         lambda p, x: gated_deltanet.forward(p, x, mc)[0]),
      "moe": (shapes(lambda k: moe.init(k, mc)), lambda p, x: moe.forward(p, x, mc)[0]),
      "rms_norm": (jax.ShapeDtypeStruct((mc.hidden_size,), mc.jnp_param_dtype),
                   lambda w, x: norm.rms_norm(x, w, mc.rms_norm_eps)),
  }


def programs(mc, rows: int, seq: int) -> dict:
  """name -> (loss fn of (params, inputs), abstract args): the whole model and each part."""
  dt = mc.jnp_dtype
  x = jax.ShapeDtypeStruct((rows, seq, mc.hidden_size), dt)
  tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
  params = jax.eval_shape(lambda k: qwen3_5.init_params(mc, k), jax.random.key(0))
  out = {"model": (lambda p, t: train_step.token_logprobs(mc, p, t, 1.0)[0].sum(), (params, tokens))}
  for name, (p, apply) in layers(mc, rows, seq).items():
    out[name] = ((lambda apply: lambda p, x: apply(p, x).astype(jnp.float32).sum())(apply), (p, x))
  out["lm_head_logprobs"] = (
      lambda p, x: qwen3_5.token_logprobs(mc, p, x, jnp.zeros((rows, seq), jnp.int32))[0].sum(),
      ({"lm_head": params["lm_head"], "embed": params["embed"]}, x))
  return {k: out[k] for k in ("model",) + PARTS}


def stacked(mc, rows: int, seq: int, name: str, n: int):
  """(loss fn, abstract args) of `n` layers of part `name` in a `lax.scan`, each added to the
  residual stream, the loss weighting the output by the input (a cotangent that is data)."""
  p, apply = layers(mc, rows, seq)[name]
  ps = jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape, a.dtype), p)
  x = jax.ShapeDtypeStruct((rows, seq, mc.hidden_size), mc.jnp_dtype)

  def loss(ps, x):
    y, _ = jax.lax.scan(lambda h, p: (h + apply(p, h).astype(h.dtype), None), x, ps)
    return jnp.sum(y.astype(jnp.float32) * x.astype(jnp.float32))
  return loss, (ps, x)


def for_target(mc, target: str):
  """(model config, trace context, device) to compile `mc` for `target` as a run there would."""
  if target == "cpu":
    return mc, contextlib.nullcontext(), None
  device = aot.target_devices(f"{target}:1x1")[0]
  if attention.stands_in_for_cudnn(mc, device.platform):   # as the compile mode does
    mc = mc.replace(attention_impl="pallas")
  return mc, config_lib.compiling_for(device.platform), device


def measure(mc, rows: int, seq: int, target: str, names, kept: bool = True, log=print) -> dict:
  """{name: {"temp": bytes, "kept": bytes (layer parts, with `kept`)}} compiled for `target`,
  and {"plan": plan.activation_bytes, "plan_parts": plan.part_bytes} as traced for it."""
  mc, context, device = for_target(mc, target)
  tok = rows * seq
  out = {}
  with context:
    planned = plan.activation_bytes(mc, seq, rows, 1)
    # (an older rl/plan.py, without per-part figures, when run against an older checkout)
    parts = plan.part_bytes(mc, seq, rows) if hasattr(plan, "part_bytes") else {}
    progs = programs(mc, rows, seq)
    for name in names:
      t0 = time.time()
      fn, fargs = progs[name]
      compiled = _compile(fn, fargs, device)
      row = {"temp": int(compiled.memory_analysis().temp_size_in_bytes)}
      if target != "cpu":   # the kernels a GPU launches a step, its roofline (aot.hlo_costs)
        costs = aot.hlo_costs(compiled.as_text(), spec=aot.DEVICES[target])
        row.update(kernels=costs["kernels"], roofline_s=costs["roofline_seconds"],
                   traffic=costs["traffic_bytes"])
      if kept and name in LAYERS:
        two, three = (temp_bytes(*stacked(mc, rows, seq, name, n), device) for n in (2, 3))
        row["kept"] = three - two
      out[name] = row
      kib = lambda b: f"{b / tok / 1024:8.2f}"
      if name == "model":
        log(f"  {target:5s} {name:17s} temp {row['temp'] / MiB:9.1f} MiB  {kib(row['temp'])} KiB a "
            f"token   {row['temp'] / planned['total']:.2f}x the plan's {planned['total'] / MiB:.0f} "
            f"MiB" + (f"   {row['kernels']:,} kernels" if "kernels" in row else "")
            + (_roofline(mc, tok, seq, row, aot.DEVICES[target]) if "roofline_s" in row else "")
            + f"   (compile {time.time() - t0:.0f} s)")
        continue
      p = parts.get(name)
      line = f"  {target:5s} {name:17s} peak {kib(row['temp'])} KiB a token"
      line += f" (plan {kib(p['kept'] + p['working'])})" if p else ""
      if "kept" in row:
        line += f"   kept a layer {kib(row['kept'])}" + (f" (plan {kib(p['kept'])})" if p else "")
      log(line + f"   (compile {time.time() - t0:.0f} s)")
  return {"parts": out, "plan": planned, "plan_parts": parts}


def _roofline(mc, tokens: int, seq: int, row: dict, spec) -> str:
  """The model step's roofline estimate and the MFU it allows (the benchmark's model FLOPs)."""
  mfu = accelerator.flops_per_token(mc, seq) * tokens / (row["roofline_s"] * spec.peak_bf16_flops)
  return (f"   roofline {1e3 * row['roofline_s']:.1f} ms, MFU at most {100 * mfu:.1f}% "
          f"(an estimate; HBM traffic {row['traffic'] / GiB:.0f} GiB)")


def size_config(size: str, remat: str, gdn_scan: str = GDN_SCANS[0], moe_dispatch: str = "auto",
                gdn_recompute: bool = True, sets=()):
  """The ModelConfig of accelerator.py's `size` in bfloat16 with these settings, then each
  "model.KEY=VALUE" of `sets` (any model field; an unknown key is an error)."""
  m = accelerator.model_fields(accelerator.SIZES[size], "bfloat16")
  m.update(remat=remat, gdn_scan=gdn_scan, moe_dispatch=moe_dispatch,
           gdn_recompute=gdn_recompute)
  for kv in sets:
    if not kv.startswith("model."):
      raise SystemExit(f"activation_memory.py: --set takes model.KEY=VALUE, got {kv!r}")
  bench_overrides.apply(m, [kv[len("model."):] for kv in sets])
  return qwen3_5.config_from_dict(m)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--targets", default="cpu,h200", help="comma list of cpu | a GPU kind (h200, h100)")
  ap.add_argument("--size", default="1b", choices=tuple(accelerator.SIZES),
                  help="benchmarks/accelerator.py SIZES: 1b, a3b_slice, or smoke (a seconds-long check)")
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--remat", default="none", choices=("none", "full"))
  ap.add_argument("--parts", default="", help="comma list of model and parts to compile (default: all)")
  ap.add_argument("--kept", default="true", choices=("true", "false"),
                  help="also compile 2- and 3-layer stacks of each layer part (what a layer keeps)")
  ap.add_argument("--gdn_scan", default=GDN_SCANS[0], choices=GDN_SCANS,
                  help="model.gdn_scan: the chunked delta rule's walk over chunks")
  ap.add_argument("--moe_dispatch", default="auto", choices=MOE_DISPATCHES,
                  help="model.moe_dispatch: how the routed rows meet the experts (auto: the "
                  "target's)")
  ap.add_argument("--gdn_recompute", default="true", choices=("true", "false"),
                  help="model.gdn_recompute: the Gated DeltaNet mixer recomputed in the backward")
  ap.add_argument("--set", action="append", default=[], metavar="model.KEY=VALUE",
                  help="any other model field (repeatable), e.g. model.gdn_storage_dtype=bfloat16")
  args = ap.parse_args(argv)
  rows = args.tokens // args.seq
  mc = size_config(args.size, args.remat, args.gdn_scan, args.moe_dispatch,
                   args.gdn_recompute == "true", args.set)
  planned = plan.activation_bytes(mc, args.seq, rows, 1)
  tok = rows * args.seq
  print(f"{args.size} MoE ({qwen3_5.count_params(mc)['total'] / 1e9:.2f} B params), {rows} x "
        f"{args.seq} tokens, remat={mc.remat}, bfloat16; plan's activations (traced for this CPU) "
        f"{planned['total'] / MiB:.0f} MiB ({planned['total'] / tok / 1024:.1f} KiB a token)",
        flush=True)
  wanted = [p for p in args.parts.split(",") if p] or ["model", *PARTS]
  unknown = set(wanted) - {"model", *PARTS}
  if unknown:
    ap.error(f"unknown parts {sorted(unknown)}; known: model, {', '.join(PARTS)}")
  results = {}
  for target in args.targets.split(","):
    results[target] = measure(mc, rows, args.seq, target, wanted, args.kept == "true",
                              log=lambda s: print(s, flush=True))
  print(json.dumps({"size": args.size, "tokens": tok, "seq": args.seq, "remat": mc.remat,
                    "targets": results}))
  return results


if __name__ == "__main__":
  main()
