"""Causal-block attention (`model.attention_causal_block`) against one [seq, seq] block, side by
side on the tiny default's model: forward+backward of the whole model (what an SFT or GRPO
micro-batch costs) and the forward alone (what a prefill costs), per block size.

  python benchmarks/attention_blocks.py                        # [8, 2560], blocks 0,256,512,1024
  python benchmarks/attention_blocks.py --batch=1 --seq=2304 --blocks=0,512
  python benchmarks/attention_blocks.py --query_chunk=256 --blocks=0,1024   # the long-context path

Each arm is compiled first, then the arms are timed in turns (`--rounds` rounds, median), so a
change in the machine's speed lands on all of them alike. Prints one line per arm with its
ratio to block 0 (one block), and the largest difference of its loss from block 0's.
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
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=2560)
  ap.add_argument("--blocks", default="0,256,512,1024")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--query_chunk", type=int, default=0,
                  help="model.attention_query_chunk in every arm (0 = off)")
  args = ap.parse_args()
  base = qwen3_5.config_from_dict(tiny_cpu.get_config().model)
  base = base.replace(attention_causal_block=0, attention_query_chunk=args.query_chunk)
  key = jax.random.key(0)
  params = qwen3_5.init_params(base, key)
  tokens = jax.random.randint(key, (args.batch, args.seq), 0, base.vocab_size)

  def loss(cfg, p, t):
    logits = qwen3_5.forward(cfg, p, t)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
        logits, t[..., None], -1)[..., 0])

  arms = {}
  for b in [int(x) for x in args.blocks.split(",")]:
    cfg = base.replace(attention_causal_block=b)
    fwd = jax.jit(lambda p, t, cfg=cfg: loss(cfg, p, t))
    step = jax.jit(jax.value_and_grad(lambda p, t, cfg=cfg: loss(cfg, p, t)))
    t0 = time.perf_counter()
    value = float(jax.block_until_ready(step(params, tokens))[0])
    jax.block_until_ready(fwd(params, tokens))
    arms[b] = dict(fwd=fwd, step=step, value=value, compile_s=time.perf_counter() - t0,
                   t_step=[], t_fwd=[])
  for _ in range(args.rounds):
    for a in arms.values():
      t0 = time.perf_counter()
      jax.block_until_ready(a["step"](params, tokens))
      a["t_step"].append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      jax.block_until_ready(a["fwd"](params, tokens))
      a["t_fwd"].append(time.perf_counter() - t0)
  ref = arms[min(arms)]
  ref_step, ref_fwd = np.median(ref["t_step"]), np.median(ref["t_fwd"])
  print(f"tiny default's model, batch {args.batch} x {args.seq} tokens, query chunk "
        f"{args.query_chunk or 'off'}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), median of {args.rounds} interleaved rounds")
  for b, a in arms.items():
    s, f = np.median(a["t_step"]), np.median(a["t_fwd"])
    print(f"causal block {b or 'off':>5}: fwd+bwd {s * 1e3:7.0f} ms ({s / ref_step:.3f}x)  "
          f"fwd {f * 1e3:6.0f} ms ({f / ref_fwd:.3f}x)  compile {a['compile_s']:5.1f} s  "
          f"|loss - off| {abs(a['value'] - ref['value']):.1e}")


if __name__ == "__main__":
  main()
