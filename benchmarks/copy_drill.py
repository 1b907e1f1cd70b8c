"""Copy drill: how fast variants of the tiny model learn to copy, side by side in one run.

Level-1 agent tasks are copying tasks at heart (a path from the prompt into a tool call, a
figure from the tool's output into the answer), so a configuration that cannot learn to copy
cannot learn them. The rows are the ones SFT mixes in (`rl.loop.copy_drill_batch`,
`sft.copy_drill_rows`): `x_1..x_n x_1..x_n` with x uniform over the ordinary tokens, loss and
accuracy on the second copy after its first token. Every variant starts from the tiny default
(configs/tiny_cpu.py) with the same seeds, batches and optimizer; one overrides its model
fields.

  python benchmarks/copy_drill.py                        # the default variants, 300 steps
  python benchmarks/copy_drill.py --steps=150 --variants=tiny_cpu,untied_quarter_rotary

Prints the copy loss / accuracy of each variant every --every steps, the first step at which
copy accuracy reaches 0.5 (or none) and a JSON summary as the last line. Uniform loss is
ln(vocab) ~ 6.9.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from configs import tiny_cpu  # noqa: E402
from envs.chat.tokenizer import ordinary_id_range  # noqa: E402
from models import qwen3_5  # noqa: E402
from rl import loop  # noqa: E402

# name -> model-field overrides on top of configs/tiny_cpu.py.
VARIANTS = {
    "tiny_cpu": {},
    "untied_quarter_rotary": dict(tie_word_embeddings=False, partial_rotary_factor=0.25),
    "untied": dict(tie_word_embeddings=False),
    "quarter_rotary": dict(partial_rotary_factor=0.25),
}


def run_variant(overrides, args):
  m = tiny_cpu.get_config().model
  m.update(overrides)
  cfg = qwen3_5.config_from_dict(m)
  params = qwen3_5.init_params(cfg, jax.random.key(args.seed))
  opt = optax.adamw(optax.warmup_constant_schedule(0.0, args.lr, 20), 0.9, 0.98,
                    weight_decay=0.01)
  opt_state = opt.init(params)
  low, high = ordinary_id_range(tiny_cpu.get_config().tokenizer.special_ids, cfg.vocab_size)
  scores = loop.sft_eval_fn(cfg)  # per row: (-logp, scored tokens, argmax hits)

  @jax.jit
  def step(p, s, batch):
    loss, grads = jax.value_and_grad(lambda q: loop.sft_loss(cfg, q, batch))(p)
    updates, s = opt.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss

  rng = np.random.default_rng(args.seed)
  curve, first_half = [], None
  t0 = time.perf_counter()
  for i in range(args.steps + 1):
    # The rows the tiny base is trained on (sft.copy_drill_rows), scored before the update.
    batch = loop.copy_drill_batch(rng, args.batch, args.length, low, high)
    _, counts, hits = scores(params, batch)
    acc = float(hits.sum() / counts.sum())
    params, opt_state, loss = step(params, opt_state, batch)
    if first_half is None and acc >= 0.5:
      first_half = i
    if i % args.every == 0:
      curve.append((i, round(float(loss), 3), round(acc, 3)))
      print(f"  step {i:4d}  copy loss {float(loss):.3f}  copy acc {acc:.3f}", flush=True)
  return {"curve": curve, "first_step_acc_0.5": first_half,
          "seconds": round(time.perf_counter() - t0, 1)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--variants", default="tiny_cpu,untied_quarter_rotary")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--every", type=int, default=50)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--length", type=int, default=32, help="tokens copied per row")
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  names = args.variants.split(",")
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    ap.error(f"unknown variant(s) {unknown}; known: {sorted(VARIANTS)}")
  summary = {}
  for name in names:
    print(f"{name} {VARIANTS[name] or '(configs/tiny_cpu.py as is)'}", flush=True)
    summary[name] = run_variant(VARIANTS[name], args)
    print(f"  first step with copy acc >= 0.5: {summary[name]['first_step_acc_0.5']}; "
          f"{summary[name]['seconds']}s", flush=True)
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
