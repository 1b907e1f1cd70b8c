"""What donating a step's params saves when a layer loop reads them (compiler figures).

  python benchmarks/donated_loop_params.py                    # XLA:CPU and an H200 target
  python benchmarks/donated_loop_params.py --targets=cpu      # without the CUDA plugin

A train step reads its stacked layer weights [layers, d, d] inside a loop (the model's layer
scan) and writes the updated weights out. Donated (`donate_argnums`, as rl/train_step.py and
rl/sft.py do), the update may go into the input's buffer; the program below is that step at toy
size, compiled with and without donation, for each way of writing the loop over layers: a
`lax.scan` over the stacked weights (the model's), a `fori_loop` indexing them, the scan behind
an optimization barrier, the scan with each layer rematerialised, and the layers written out
(no loop). For each, `aot.memory`: temporaries, and the total (arguments + outputs - aliased
+ temporaries + code), in MiB. No timing: nothing runs. The last line is JSON.
"""
import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from models import aot  # noqa: E402

MiB = 1 << 20


def _layer(h, w):
  return jnp.tanh(h @ w.astype(jnp.bfloat16))


def _loops(layers: int) -> dict:
  """name -> (stacked weights, x) -> h after every layer."""
  scan = lambda p, x: jax.lax.scan(lambda h, w: (_layer(h, w), None), x, p)[0]

  def unrolled(p, x):
    for i in range(layers):
      x = _layer(x, p[i])
    return x

  return {
      "scan": scan,
      "fori_loop": lambda p, x: jax.lax.fori_loop(0, layers, lambda i, h: _layer(h, p[i]), x),
      "scan behind a barrier": lambda p, x: scan(jax.lax.optimization_barrier(p), x),
      "scan, layers remat": lambda p, x: jax.lax.scan(
          lambda h, w: (jax.checkpoint(_layer)(h, w), None), x, p)[0],
      "no loop (unrolled)": unrolled,
  }


def measure(target: str, layers: int, width: int, rows: int) -> list[dict]:
  """One row per loop form: MiB of temporaries and in all, without and with donation."""
  device = jax.devices("cpu")[0] if target == "cpu" else aot.target_devices(f"{target}:1x1")[0]
  one = jax.sharding.SingleDeviceSharding(device)
  p = jax.ShapeDtypeStruct((layers, width, width), jnp.float32, sharding=one)
  x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16, sharding=one)
  out = []
  for name, forward in _loops(layers).items():
    loss = lambda q, y: (forward(q, y).astype(jnp.float32) ** 2).mean()
    row = {"target": target, "loop": name, "params_mib": p.size * 4 / MiB}
    for donate in (False, True):
      @functools.partial(jax.jit, donate_argnums=(0,) if donate else ())
      def step(q, y):
        value, grad = jax.value_and_grad(loss)(q, y)
        return q - 1e-3 * grad, value
      m = aot.memory(aot.compile_lowered(step.lower(p, x)))
      key = "donated" if donate else "kept"
      row[f"temp_mib_{key}"] = m["temp"] / MiB
      row[f"total_mib_{key}"] = m["total"] / MiB
    out.append(row)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--targets", default="cpu,h200", help="cpu and/or GPU/TPU kinds (aot.DEVICES)")
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--width", type=int, default=4096)
  ap.add_argument("--rows", type=int, default=256)
  a = ap.parse_args()
  rows = []
  print(f"{'target':8} {'loop':24} {'temp kept':>10} {'temp donated':>13} {'total kept':>11} "
        f"{'total donated':>14}  (MiB; params {a.layers * a.width * a.width * 4 / MiB:.0f})")
  for target in a.targets.split(","):
    for r in measure(target, a.layers, a.width, a.rows):
      rows.append(r)
      print(f"{target:8} {r['loop']:24} {r['temp_mib_kept']:10.0f} {r['temp_mib_donated']:13.0f} "
            f"{r['total_mib_kept']:11.0f} {r['total_mib_donated']:14.0f}", flush=True)
  print(json.dumps(rows))


if __name__ == "__main__":
  main()
