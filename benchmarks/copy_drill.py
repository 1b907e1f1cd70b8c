"""Copy drill: how fast variants of the tiny model learn to copy, side by side in one run.

Level-1 agent tasks are copying tasks at heart (a path from the prompt into a tool call, a
figure from the tool's output into the answer), so a configuration that cannot learn to copy
cannot learn them. The rows are the ones SFT mixes in (`rl.sft.copy_drill_batch`,
`sft.copy_drill_rows`): a segment of --length tokens uniform over the ordinary tokens and its
copy, loss and accuracy on the copy after its first token. With --row_len=2*length the row is
`x x` (the copy always `length` tokens on); longer rows put segment and copy at random places
in random filler. Every variant starts from the tiny default (configs/tiny_cpu.py) with the
same seeds, batches and optimizer; one overrides its model fields.

Besides the training rows, every report scores a fixed held-out batch of content-copy rows
(--probe_len tokens, random offsets): a model that copies by relative position only (what the
`x x` rows allow) scores ~0 there however well it does on its training rows.

  python benchmarks/copy_drill.py                        # the default variants, 300 steps
  python benchmarks/copy_drill.py --steps=150 --row_len=64   # the fixed-offset `x x` rows

Prints the copy loss / accuracy (training rows) and the probe accuracy of each variant every
--every steps, the first step at which each accuracy reaches 0.5 (or none) and a JSON summary
as the last line. Uniform loss is ln(vocab) ~ 6.9.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from configs import tiny_cpu  # noqa: E402
from envs.chat.tokenizer import ordinary_id_range  # noqa: E402
from models import qwen3_5  # noqa: E402
from rl import sft  # noqa: E402

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
  scores = sft.sft_eval_fn(cfg)  # per row: (-logp, scored tokens, argmax hits)

  @jax.jit
  def step(p, s, batch):
    loss, grads = jax.value_and_grad(lambda q: sft.sft_loss(cfg, q, batch))(p)
    updates, s = opt.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss

  rng = np.random.default_rng(args.seed)
  probe = sft.copy_drill_batch(np.random.default_rng([args.seed, 7]), args.batch, args.length,
                                low, high, row_len=args.probe_len)
  curve, first_half, first_probe_half = [], None, None
  t0 = time.perf_counter()
  for i in range(args.steps + 1):
    # The rows the tiny base is trained on (sft.copy_drill_rows), scored before the update.
    batch = sft.copy_drill_batch(rng, args.batch, args.length, low, high, row_len=args.row_len)
    _, counts, hits = scores(params, batch)
    acc = float(hits.sum() / counts.sum())
    params, opt_state, loss = step(params, opt_state, batch)
    if first_half is None and acc >= 0.5:
      first_half = i
    if i % args.every == 0:
      _, counts, hits = scores(params, probe)
      probe_acc = float(hits.sum() / counts.sum())
      if first_probe_half is None and probe_acc >= 0.5:
        first_probe_half = i
      curve.append((i, round(float(loss), 3), round(acc, 3), round(probe_acc, 3)))
      print(f"  step {i:4d}  copy loss {float(loss):.3f}  copy acc {acc:.3f}  "
            f"probe acc {probe_acc:.3f}", flush=True)
  return {"curve": curve, "first_step_acc_0.5": first_half,
          "first_report_probe_acc_0.5": first_probe_half,
          "seconds": round(time.perf_counter() - t0, 1)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--variants", default="tiny_cpu,untied_quarter_rotary")
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--every", type=int, default=50)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--length", type=int, default=32, help="tokens copied per row")
  ap.add_argument("--row_len", type=int, default=256,
                  help="training row length; 2*length = the fixed-offset `x x` rows")
  ap.add_argument("--probe_len", type=int, default=512, help="held-out content-copy row length")
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
    r = summary[name]
    print(f"  first step with copy acc >= 0.5: {r['first_step_acc_0.5']}; first report with "
          f"probe acc >= 0.5: {r['first_report_probe_acc_0.5']}; {r['seconds']}s", flush=True)
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
