"""Many-turn conversations through the JetStream server, turn cache off vs on, side by side.

    python benchmarks/turn_cache.py                      # 16 conversations x 12 turns, 8 at a time
    python benchmarks/turn_cache.py --turns=20 --obs=32 --reply=16

The shape of a long agent episode: a shared system turn, then many turns each adding a short
reply and a short tool result. Without the turn cache every turn's prompt is prefilled again
from the end of the shared system turn (rl/rollout/prefix_cache.py), so an episode prefills
O(turns^2) tokens; with it, only each turn's new tokens. Both arms serve the same weights (the
tiny default's `train.init_from`) to the same conversations (random "tool output" ids, greedy
replies) on a fresh server each, twice (the first pass pays the lazy compiles); prints wall time
by pass, prompt tokens and tokens prefilled, the turn cache's counts, and how many conversations came out identical in both arms (greedy over two
float paths: a near-tie may flip a token). Asserts nothing.
"""
import argparse
import os
import sys
import time
from concurrent import futures

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from configs import tiny_cpu  # noqa: E402
from envs.harness.jetstream_client import TokenClient  # noqa: E402
from envs.harness.policy import SamplingParams  # noqa: E402
from rl import metrics  # noqa: E402
from rl import params_io  # noqa: E402
from rl.rollout.serve import build_server  # noqa: E402


def run_arm(config, params, turn_cache: int, args):
  cfg = config.copy_and_resolve_references()
  with cfg.unlocked():
    cfg.rollout.turn_cache = turn_cache
  server = build_server(cfg, params=params, port=0, warmup=True)
  rng = np.random.default_rng(0)
  vocab = server.engine.cfg.vocab_size
  system = rng.integers(10, vocab, args.system).tolist()
  convs = [(rng.integers(10, vocab, args.task).tolist(),
            [rng.integers(10, vocab, args.obs).tolist() for _ in range(args.turns)])
           for _ in range(args.conversations)]
  greedy = SamplingParams(temperature=0.0)

  def converse(task, observations):
    client = TokenClient(server.address, timeout_s=600)
    prompt = system + task
    try:
      for obs in observations:
        prompt = prompt + client.generate(prompt, greedy, args.reply, []).ids + obs
    finally:
      client.close()
    return prompt

  try:
    e = server.engine
    walls = []
    for _ in range(args.passes):   # the first pass also pays the shapes' lazy compiles
      tokens0, prefilled0 = e.prompt_tokens, e.prefilled_tokens
      t0 = time.monotonic()
      with futures.ThreadPoolExecutor(args.concurrency) as pool:
        outs = list(pool.map(lambda c: converse(*c), convs))
      walls.append(time.monotonic() - t0)
    return dict(walls=walls, wall=walls[-1], outs=outs, prompt_tokens=e.prompt_tokens - tokens0,
                prefilled=e.prefilled_tokens - prefilled0, stats=e.turn_cache_stats())
  finally:
    server.stop()


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--conversations", type=int, default=16)
  ap.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
  ap.add_argument("--turns", type=int, default=12)
  ap.add_argument("--system", type=int, default=704, help="shared system-turn tokens")
  ap.add_argument("--task", type=int, default=100, help="task-prompt tokens")
  ap.add_argument("--reply", type=int, default=24, help="tokens sampled a turn")
  ap.add_argument("--obs", type=int, default=48, help="tool-output tokens a turn")
  ap.add_argument("--keep", type=int, default=16, help="rollout.turn_cache of the second arm")
  ap.add_argument("--passes", type=int, default=2, help="runs of the conversations; the last is compared")
  args = ap.parse_args()

  metrics.quiet_logs()
  config = tiny_cpu.get_config()
  params = params_io.init_params(config)
  arms = [run_arm(config, params, 0, args), run_arm(config, params, args.keep, args)]
  print(f"\n{args.conversations} conversations x {args.turns} turns ({args.concurrency} at a time): "
        f"system {args.system}, task {args.task}, reply {args.reply}, tool output {args.obs} tokens; "
        f"{config.rollout.slots} slots, max_len {config.rollout.max_len}")
  for name, r in zip(("turn cache off", f"turn_cache={args.keep}"), arms):
    print(f"{name}: {' / '.join(f'{w:.1f}' for w in r['walls'])} s by pass; last pass: prompt tokens "
          f"{r['prompt_tokens']}, prefilled "
          f"{r['prefilled']} ({r['prefilled'] / max(1, r['prompt_tokens']):.3f})")
    if r["stats"]:
      print("  turn cache: " + ", ".join(f"{k} {v}" for k, v in r["stats"].items()))
  same = sum(a == b for a, b in zip(arms[0]["outs"], arms[1]["outs"]))
  print(f"last pass wall time on / off: {arms[1]['wall'] / arms[0]['wall']:.3f}; tokens prefilled on / off: "
        f"{arms[1]['prefilled'] / max(1, arms[0]['prefilled']):.3f}; identical conversations "
        f"{same} of {len(arms[0]['outs'])}")


if __name__ == "__main__":
  main()
