"""What a wider tiny model costs on this machine: forward+backward of the whole model at the
tiny default's shapes (layers, heads, vocabulary, attention knobs) with the residual width and
the expert widths scaled, side by side (arms interleaved, median).

  python benchmarks/model_width.py                    # hidden 64 (the default), 128, 256 on 8 x 2560
  python benchmarks/model_width.py --hidden=64,192 --batch=4

Expert and shared-expert widths scale with the hidden size (half of it, as in the default).
Prints parameters, time and the ratio to the first arm.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import tiny_cpu  # noqa: E402
from models import qwen3_5  # noqa: E402


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--hidden", default="64,128,256")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=2560)
  ap.add_argument("--rounds", type=int, default=3)
  args = ap.parse_args()
  base = qwen3_5.config_from_dict(tiny_cpu.get_config().model)
  key = jax.random.key(0)
  tokens = jax.random.randint(key, (args.batch, args.seq), 0, base.vocab_size)
  arms = []
  for h in [int(x) for x in args.hidden.split(",")]:
    cfg = base.replace(hidden_size=h, moe_intermediate_size=h // 2,
                       shared_expert_intermediate_size=h // 2)
    params = qwen3_5.init_params(cfg, key)
    grad = jax.jit(jax.grad(lambda p, t, cfg=cfg: jnp.mean(
        jax.nn.logsumexp(qwen3_5.forward(cfg, p, t), -1))))
    jax.block_until_ready(grad(params, tokens))
    arms.append(dict(hidden=h, grad=grad, params=params, times=[],
                     n=sum(x.size for x in jax.tree.leaves(params))))
  for _ in range(args.rounds):
    for a in arms:
      t0 = time.perf_counter()
      jax.block_until_ready(a["grad"](a["params"], tokens))
      a["times"].append(time.perf_counter() - t0)
  ref = np.median(arms[0]["times"])
  print(f"forward+backward, batch {args.batch} x {args.seq} tokens, {jax.devices()[0].platform}, "
        f"median of {args.rounds} interleaved rounds")
  for a in arms:
    t = np.median(a["times"])
    print(f"hidden {a['hidden']:4d}: {a['n'] / 1e6:5.2f}M params  {t * 1e3:7.0f} ms  {t / ref:.2f}x")


if __name__ == "__main__":
  main()
