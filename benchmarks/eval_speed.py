"""Wall time of `make run`'s held-out eval under two rollout settings, side by side.

    python benchmarks/eval_speed.py                       # prefill buckets (1024, 2304) vs the config's
    python benchmarks/eval_speed.py --max_tasks=48 --b=1024,1536,2304
    python benchmarks/eval_speed.py --a= --set_b=harness.num_workers=8   # the config's buckets, 4 vs 8 workers
    python benchmarks/eval_speed.py --a= --set_a=rollout.prefix_cache=False  # shared-prefix cache off vs on
    python benchmarks/eval_speed.py --a= --set_b=rollout.turn_cache=8 --passes=2  # turn cache off vs on

A prompt is padded up to the smallest prefill bucket that holds it, so the bucket set decides
how many pad tokens each prefill computes. For each arm: a fresh server (engine + gRPC) on the
same weights (config.train.init_from), its warmup (one prefill + insert compile per bucket)
timed, then the held-out eval of `make run` (same tasks, seeds and temperature) through a fresh
agent pool, timed. Prints, per arm, how the prompt lengths it prefilled (each assistant turn's,
from the returned trajectories) fall into its buckets, the episode time by phase summed over
episodes, and pass@1: buckets only pad, so the arms agree up to float reductions over padded
shapes. Asserts nothing.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import bench_overrides as config_overrides  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])

from configs import tiny_cpu  # noqa: E402
from envs import eval_summary  # noqa: E402
from envs import worlds  # noqa: E402
from envs.chat import ChatFormat, load_tokenizer  # noqa: E402
from envs.harness.jetstream_client import jetstream_policy_factory  # noqa: E402
from envs.harness.pool import AgentPool  # noqa: E402
from rl import evaluation  # noqa: E402
from rl import metrics  # noqa: E402
from rl import params_io  # noqa: E402
from rl.rollout import draw  # noqa: E402
from rl import task_data  # noqa: E402
from rl.rollout.serve import build_server  # noqa: E402


def _buckets(text: str) -> tuple:
  return tuple(int(b) for b in text.split(",") if b)


def prefill_lengths(results, fmt) -> list:
  """The length of every prompt the policy was handed: the ids before each assistant turn."""
  marker = fmt.tok.encode("<|im_start|>assistant")
  out = []
  for r in results:
    ids = list(r.tokens)
    for i in range(len(ids) - len(marker) + 1):
      if ids[i:i + len(marker)] == marker:
        out.append(i + len(marker) + 1)   # + the newline the template puts after the role
  return out


def run_arm(config, params, buckets, overrides, tasks, fmt, passes: int = 1):
  cfg = config.copy_and_resolve_references()
  with cfg.unlocked():
    cfg.rollout.prefill_buckets = buckets
    config_overrides.apply(cfg, overrides)
  t0 = time.monotonic()
  server = build_server(cfg, params=params, port=0, warmup=True)
  t_warm = time.monotonic() - t0
  with cfg.unlocked():
    cfg.rollout.address = server.address
  try:
    with AgentPool.from_config(cfg, jetstream_policy_factory(cfg)) as pool:
      eps = task_data.make_episodes(tasks, cfg, cfg.loop.eval_samples, seed_offset=7919,
                               temperature=evaluation.eval_temperature(cfg))
      pass_s = []
      for _ in range(passes):   # later passes: every shape compiled, as in make run's second eval
        t0 = time.monotonic()
        results = draw.run_pool(pool, eps, cfg, f"eval, buckets {buckets}")
        pass_s.append(time.monotonic() - t0)
      t_eval = pass_s[0]
    engine_buckets = server.engine.buckets
    prefix_stats = server.engine.prefix_cache_stats()
    turn_stats = server.engine.turn_cache_stats()
    prompt_tokens, prefilled = server.engine.prompt_tokens, server.engine.prefilled_tokens
  finally:
    server.stop()
  s = eval_summary.summarize(results, tasks, cfg.loop.bootstrap, cfg.seed)
  lens = np.array(prefill_lengths(results, fmt))
  use = {b: int(np.sum((lens <= b) & (lens > lo))) for lo, b in
         zip((0,) + engine_buckets[:-1], engine_buckets)}
  timing = {k: float(np.sum([r.timing.get(k, 0.0) for r in results])) for k in
            sorted({k for r in results for k in r.timing})}
  pad = float(np.mean([min(b for b in engine_buckets if b >= n) - n for n in lens])) if len(lens) else 0.0
  return {"buckets": engine_buckets, "warmup_s": t_warm, "eval_s": t_eval, "pass_s": pass_s, "pass_at_1": s["pass_at_1"],
          "ci": s["pass_at_1_ci95"], "prefills": len(lens), "per_bucket": use, "mean_pad": pad,
          "timing": timing, "prefix_cache": prefix_stats, "turn_cache": turn_stats,
          "prompt_tokens": prompt_tokens, "prefilled_tokens": prefilled}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--a", default="1024,2304", help="bucket set A (comma-separated); empty = the config's")
  ap.add_argument("--b", default="", help="bucket set B; empty = the config's")
  ap.add_argument("--set_a", action="append", default=[], help="key=value config override for arm A")
  ap.add_argument("--set_b", action="append", default=[], help="key=value config override for arm B")
  ap.add_argument("--max_tasks", type=int, default=0, help="first N held-out tasks; 0 = all")
  ap.add_argument("--passes", type=int, default=1,
                  help="evals per arm on one server (the first pays the lazy compiles)")
  args = ap.parse_args()

  metrics.quiet_logs()
  config = tiny_cpu.get_config()
  worlds.ensure_worlds(config.envs)
  params = params_io.init_params(config)
  tasks = task_data.select_tasks(config, "eval", config.loop.eval_levels, args.max_tasks)
  fmt = ChatFormat(load_tokenizer(config.tokenizer.path, config.tokenizer.special_ids),
                   config.tokenizer.thinking)
  own = tuple(config.rollout.prefill_buckets)
  out = [run_arm(config, params, _buckets(args.a) or own, args.set_a, tasks, fmt, args.passes),
         run_arm(config, params, _buckets(args.b) or own, args.set_b, tasks, fmt, args.passes)]
  print(f"\n{len(tasks)} held-out tasks, temperature {evaluation.eval_temperature(config)}, "
        f"{config.rollout.slots} slots, {config.harness.num_workers} agent workers")
  for name, r in zip("AB", out):
    lo, hi = r["ci"]
    sets = args.set_a if name == "A" else args.set_b
    extra = f" ({', '.join(sets)})" if sets else ""
    print(f"{name}{extra} buckets {r['buckets']}: warmup {r['warmup_s']:.1f} s, eval {r['eval_s']:.1f} s, "
          f"pass@1 {r['pass_at_1']:.3f} [{lo:.3f}, {hi:.3f}]; {r['prefills']} prefills, per "
          f"bucket {r['per_bucket']}, mean pad {r['mean_pad']:.0f} tokens")
    if r["prefix_cache"]:
      print("  shared-prefix cache: " + ", ".join(f"{k} {v}" for k, v in r["prefix_cache"].items()))
    if r["turn_cache"]:
      print("  turn cache: " + ", ".join(f"{k} {v}" for k, v in r["turn_cache"].items()))
    print(f"  prompt tokens {r['prompt_tokens']}, of them prefilled {r['prefilled_tokens']} "
          f"({r['prefilled_tokens'] / max(1, r['prompt_tokens']):.3f}; the rest read from cached "
          f"states), over all passes")
    print("  episode time summed over episodes (s): " +
          ", ".join(f"{k} {v:.0f}" for k, v in r["timing"].items()))
    if len(r["pass_s"]) > 1:
      print("  eval time by pass (s): " + ", ".join(f"{t:.1f}" for t in r["pass_s"]))
  a, b = out
  print(f"eval time B / A: {b['eval_s'] / a['eval_s']:.3f}; warmup + eval B / A: "
        f"{(b['warmup_s'] + b['eval_s']) / (a['warmup_s'] + a['eval_s']):.3f}")
  if args.passes > 1:
    print(f"last pass B / A: {b['pass_s'][-1] / a['pass_s'][-1]:.3f}; warmup + all passes B / A: "
          f"{(b['warmup_s'] + sum(b['pass_s'])) / (a['warmup_s'] + sum(a['pass_s'])):.3f}")


if __name__ == "__main__":
  main()
