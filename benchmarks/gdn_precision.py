"""The chunked delta rule at each `model.gdn_precision`: time and error, side by side.

    python benchmarks/gdn_precision.py                         # CPU: small shapes, a few s
    python benchmarks/gdn_precision.py --batch=8 --seq=2048 --heads=8 --dk=128 --dv=128  # a GPU
    python benchmarks/gdn_precision.py --scans=outputs,states --precisions=highest  # the scans

Times forward+backward of `gated_deltanet.chunked_delta_rule` (the Gated DeltaNet layer's
chunk scan, the part that runs in float32) at "highest" (true float32 matmuls, the default),
"high" and "default" (TF32 on an NVIDIA GPU; fewer bfloat16 passes on a TPU), in alternating
rounds so every precision sees the same load, and prints each one's median ms, its speed-up
over "highest" (median of the rounds' ratios, with their smallest and largest) and its error
against "highest": the largest difference of the output, and of each input's gradient, over
that tensor's largest magnitude. The inputs are those of a layer (unit-norm keys and queries,
log decays of -exp(A_log) softplus(a) with A up to 16). The CPU computes float32 dots
whatever they ask, so there every ratio is ~1 and every error 0. With `--scans`, each form of
the scan over chunks (`model.gdn_scan`) at each precision, against the default scan at
"highest"; JSON rows "precisions" for the default scan, "variants" keyed "scan/precision" for
all. Last line: JSON.
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

from models.config import GDN_PRECISIONS, GDN_SCANS  # noqa: E402
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


def step_fn(precision: str, chunk: int, scan: str = GDN_SCANS[0]):
  """jit of (q, k, v, g, beta, state) -> (output, gradients of sum(out * w) w.r.t. the inputs)."""
  def loss(args, w):
    out, _ = gated_deltanet.chunked_delta_rule(*args, chunk, "custom", precision, scan)
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
  ap.add_argument("--precisions", default=",".join(GDN_PRECISIONS),
                  help="comma list of model.gdn_precision values (highest is always timed)")
  ap.add_argument("--scans", default=GDN_SCANS[0],
                  help=f"comma list of model.gdn_scan values ({', '.join(GDN_SCANS)}; the "
                       f"first, {GDN_SCANS[0]}, is always timed)")
  args = ap.parse_args()
  precisions = ["highest"] + [p for p in args.precisions.split(",") if p != "highest"]
  scans = [GDN_SCANS[0]] + [x for x in args.scans.split(",") if x != GDN_SCANS[0]]
  for name, got, allowed in (("precisions", precisions, GDN_PRECISIONS),
                             ("scans", scans, GDN_SCANS)):
    if set(got) - set(allowed):
      ap.error(f"--{name}: unknown {sorted(set(got) - set(allowed))}; choose from {allowed}")
  variants = [f"{x}/{p}" for x in scans for p in precisions]
  reference = variants[0]
  inputs = layer_inputs(args.batch, args.seq, args.heads, args.dk, args.dv)
  w = jnp.asarray(np.random.default_rng(1).standard_normal(inputs[2].shape), jnp.float32)
  steps = {v: step_fn(v.split("/")[1], args.chunk, v.split("/")[0]) for v in variants}
  results = {v: jax.block_until_ready(f(inputs, w)) for v, f in steps.items()}  # compile
  times = {v: [] for v in variants}
  for r in range(args.rounds):
    order = variants if r % 2 == 0 else variants[::-1]
    for p in order:
      t0 = time.perf_counter()
      for _ in range(args.iters):
        jax.block_until_ready(steps[p](inputs, w))
      times[p].append((time.perf_counter() - t0) * 1e3 / args.iters)
  ref_out, ref_grads = results[reference]
  names = ("q", "k", "v", "g", "beta", "state")
  out = {"device": str(jax.devices()[0].device_kind), "jax_version": jax.__version__,
         "shape": {k: getattr(args, k) for k in ("batch", "seq", "heads", "dk", "dv", "chunk")},
         "rounds": args.rounds, "precisions": {}, "variants": {}}
  print(f"chunked delta rule fwd+bwd on {out['device']}, {out['shape']}; against {reference}")
  for p in variants:
    ratios = [h / t for h, t in zip(times[reference], times[p])]
    o, grads = results[p]
    row = {"ms": float(np.median(times[p])), "speedup": float(np.median(ratios)),
           "speedup_range": [min(ratios), max(ratios)],
           "output_error": relative_error(o, ref_out),
           "grad_error": {n: relative_error(g, gr) for n, g, gr in zip(names, grads, ref_grads)}}
    out["variants"][p] = row
    if p.startswith(GDN_SCANS[0] + "/"):
      out["precisions"][p.split("/")[1]] = row
    print(f"{p:16s} {row['ms']:8.2f} ms  {row['speedup']:.2f}x (rounds {min(ratios):.2f}"
          f"-{max(ratios):.2f}x)  output error {row['output_error']:.1e}  largest gradient "
          f"error {max(row['grad_error'].values()):.1e}")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
