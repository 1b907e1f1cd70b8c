"""The chunked delta rule at each `model.gdn_precision`: time and error, side by side.

    python benchmarks/gdn_precision.py                         # CPU: small shapes, a few s
    python benchmarks/gdn_precision.py --batch=8 --seq=2048 --heads=8 --dk=128 --dv=128  # a GPU

Times forward+backward of `gated_deltanet.chunked_delta_rule` (the Gated DeltaNet layer's
chunk scan, the part that runs in float32) at "highest" (true float32 matmuls, the default),
"high" and "default" (TF32 on an NVIDIA GPU; fewer bfloat16 passes on a TPU), in alternating
rounds so every precision sees the same load, and prints each one's median ms, its speed-up
over "highest" (median of the rounds' ratios, with their smallest and largest) and its error
against "highest": the largest difference of the output, and of each input's gradient, over
that tensor's largest magnitude. The inputs are those of a layer (unit-norm keys and queries,
log decays of -exp(A_log) softplus(a) with A up to 16). The CPU computes float32 dots
whatever they ask, so there every ratio is ~1 and every error 0. Last line: JSON.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import device_memory  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])

device_memory.set_policy()   # before jax starts a backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from models.config import GDN_PRECISIONS  # noqa: E402
from models.layers import gated_deltanet  # noqa: E402


def layer_inputs(batch: int, seq: int, heads: int, dk: int, dv: int, seed: int = 0) -> tuple:
  """(q, k, v, g, beta, state) float32, shaped and scaled as a Gated DeltaNet layer's."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q = gated_deltanet._l2norm(normal(batch, seq, heads, dk)) * dk ** -0.5
  k = gated_deltanet._l2norm(normal(batch, seq, heads, dk))
  a_log = jnp.asarray(np.log(rng.uniform(1, 16, (heads,))), jnp.float32)
  g = -jnp.exp(a_log) * jax.nn.softplus(normal(batch, seq, heads))
  beta = jax.nn.sigmoid(normal(batch, seq, heads))
  return q, k, normal(batch, seq, heads, dv), g, beta, jnp.zeros((batch, heads, dk, dv))


def step_fn(precision: str, chunk: int):
  """jit of (q, k, v, g, beta, state) -> (output, gradients of sum(out * w) w.r.t. the inputs)."""
  def loss(args, w):
    out, _ = gated_deltanet.chunked_delta_rule(*args, chunk, "custom", precision)
    return jnp.sum(out * w), out
  return jax.jit(lambda args, w: jax.grad(loss, has_aux=True)(args, w)[::-1])


def relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--dk", type=int, default=32)
  ap.add_argument("--dv", type=int, default=32)
  ap.add_argument("--chunk", type=int, default=64)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--iters", type=int, default=5)
  args = ap.parse_args()
  inputs = layer_inputs(args.batch, args.seq, args.heads, args.dk, args.dv)
  w = jnp.asarray(np.random.default_rng(1).standard_normal(inputs[2].shape), jnp.float32)
  steps = {p: step_fn(p, args.chunk) for p in GDN_PRECISIONS}
  results = {p: jax.block_until_ready(f(inputs, w)) for p, f in steps.items()}  # compile
  times = {p: [] for p in GDN_PRECISIONS}
  for r in range(args.rounds):
    order = GDN_PRECISIONS if r % 2 == 0 else GDN_PRECISIONS[::-1]
    for p in order:
      t0 = time.perf_counter()
      for _ in range(args.iters):
        jax.block_until_ready(steps[p](inputs, w))
      times[p].append((time.perf_counter() - t0) * 1e3 / args.iters)
  ref_out, ref_grads = results["highest"]
  names = ("q", "k", "v", "g", "beta", "state")
  out = {"device": str(jax.devices()[0].device_kind), "jax_version": jax.__version__,
         "shape": {k: getattr(args, k) for k in ("batch", "seq", "heads", "dk", "dv", "chunk")},
         "rounds": args.rounds, "precisions": {}}
  print(f"chunked delta rule fwd+bwd on {out['device']}, {out['shape']}")
  for p in GDN_PRECISIONS:
    ratios = [h / t for h, t in zip(times["highest"], times[p])]
    o, grads = results[p]
    row = {"ms": float(np.median(times[p])), "speedup": float(np.median(ratios)),
           "speedup_range": [min(ratios), max(ratios)],
           "output_error": relative_error(o, ref_out),
           "grad_error": {n: relative_error(g, gr) for n, g, gr in zip(names, grads, ref_grads)}}
    out["precisions"][p] = row
    print(f"{p:8s} {row['ms']:8.2f} ms  {row['speedup']:.2f}x (rounds {min(ratios):.2f}"
          f"-{max(ratios):.2f}x)  output error {row['output_error']:.1e}  largest gradient "
          f"error {max(row['grad_error'].values()):.1e}")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
