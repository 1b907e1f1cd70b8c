"""Where a training step's activation memory goes: the compiler's temporaries beside the plan's.

  python benchmarks/activation_memory.py                      # XLA:CPU and an H200 (compiled from here)
  python benchmarks/activation_memory.py --targets=cpu --remat=full --tokens=8192

Compiles, for each target, the forward + backward of the accelerator benchmark's ~1B MoE
(benchmarks/accelerator.py `SIZES["1b"]`, bfloat16) over --tokens tokens in rows of --seq, and
prints the program's temporary bytes (`compiled.memory_analysis()`: what the step holds beyond
its inputs and outputs, i.e. activations and scratch) beside rl/plan.py's activation estimate for
the same tokens. Then the same for each part alone, over the same tokens: one attention layer,
one Gated DeltaNet layer, one MoE feed-forward, the LM head with the log-probabilities, an RMSNorm
- so a layer kind that holds far more than the plan counts shows by name, in bytes a token.

Nothing runs: every program is lowered for abstract inputs and compiled, for the CPU and for a
compile-only H200 (XLA:GPU, `make setup-compile`); no figure here is a measurement of a run. The
last line is JSON. About 2-4 minutes on a 2-core CPU.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import accelerator  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])
from models import aot  # noqa: E402
from models import qwen3_5  # noqa: E402
from models.layers import attention  # noqa: E402
from models.layers import gated_deltanet  # noqa: E402
from models.layers import moe  # noqa: E402
from models.layers import norm  # noqa: E402
from rl import plan  # noqa: E402
from rl import train_step  # noqa: E402

MiB = 1 << 20


def _place(tree, device):
  """ShapeDtypeStructs of `tree` on `device` (None: the default device)."""
  if device is None:
    return tree
  one = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), tree)


def temp_bytes(fn, args, device) -> int:
  """Temporary bytes of jit(grad(fn)) compiled for `device` (None = this CPU)."""
  compiled = jax.jit(jax.value_and_grad(fn)).lower(*_place(args, device)).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def programs(mc, rows: int, seq: int) -> dict:
  """name -> (loss fn of (params, inputs), abstract args): the whole model and each part."""
  shapes = lambda f: jax.eval_shape(f, jax.random.key(0))
  dt = mc.jnp_dtype
  x = jax.ShapeDtypeStruct((rows, seq, mc.hidden_size), dt)
  tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq))
  params = shapes(lambda k: qwen3_5.init_params(mc, k))
  out = {
      "model": (lambda p, t: train_step.token_logprobs(mc, p, t, 1.0)[0].sum(), (params, tokens)),
      "attention": (lambda p, x: attention.forward(p, x, positions, mc)[0].astype(jnp.float32).sum(),
                    (shapes(lambda k: attention.init(k, mc)), x)),
      "gated_deltanet": (lambda p, x: gated_deltanet.forward(p, x, mc)[0].astype(jnp.float32).sum(),
                         (shapes(lambda k: gated_deltanet.init(k, mc)), x)),
      "moe": (lambda p, x: moe.forward(p, x, mc)[0].astype(jnp.float32).sum(),
              (shapes(lambda k: moe.init(k, mc)), x)),
      "lm_head_logprobs": (
          lambda p, x: qwen3_5.token_logprobs(mc, p, x, jnp.zeros((rows, seq), jnp.int32))[0].sum(),
          ({"lm_head": params["lm_head"], "embed": params["embed"]}, x)),
      "rms_norm": (lambda w, x: norm.rms_norm(x, w, mc.rms_norm_eps).astype(jnp.float32).sum(),
                   (jax.ShapeDtypeStruct((mc.hidden_size,), mc.jnp_param_dtype), x)),
  }
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--targets", default="cpu,h200", help="comma list of cpu | a GPU kind (h200, h100)")
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--remat", default="none", choices=("none", "full"))
  ap.add_argument("--parts", default="", help="comma list of parts to compile (default: all)")
  args = ap.parse_args()
  rows = args.tokens // args.seq
  mc = accelerator.model_config(accelerator.SIZES["1b"], "bfloat16")
  mc = mc.replace(remat=args.remat)
  planned = plan.activation_bytes(mc, args.seq, rows, 1)
  tok = rows * args.seq
  print(f"1B MoE ({qwen3_5.count_params(mc)['total'] / 1e9:.2f} B params), {rows} x {args.seq} "
        f"tokens, remat={mc.remat}, bfloat16; plan's activations {planned['total'] / MiB:.0f} MiB "
        f"({planned['total'] / tok / 1024:.1f} KiB a token)")
  results = {}
  progs = programs(mc, rows, args.seq)
  wanted = [p for p in args.parts.split(",") if p] or list(progs)
  for target in args.targets.split(","):
    device = None if target == "cpu" else aot.target_devices(f"{target}:1x1")[0]
    results[target] = {}
    for name in wanted:
      fn, fargs = progs[name]
      t0 = time.time()
      b = temp_bytes(fn, fargs, device)
      results[target][name] = b
      extra = ""
      if name == "model":
        extra = f"   {b / planned['total']:.2f}x the plan's {planned['total'] / MiB:.0f} MiB"
      print(f"  {target:5s} {name:17s} temp {b / MiB:9.1f} MiB  {b / tok / 1024:8.2f} KiB a token"
            f"{extra}   (compile {time.time() - t0:.0f} s)", flush=True)
  print(json.dumps({"tokens": tok, "seq": args.seq, "remat": mc.remat,
                    "plan_activation_bytes": planned, "temp_bytes": results}))


if __name__ == "__main__":
  main()
