"""Synchronous vs bounded-staleness RL steps, side by side: the same run (make run's tiny
config from the shipped base, SFT skipped) with loop.max_staleness = 0 and = K, each in its own
`launch.py --mode=rl` process, same tasks and seeds.

    python benchmarks/staleness.py                      # 6 steps, K = 1
    python benchmarks/staleness.py --steps=8 --k=2 --set=train.prompts_per_step=16

Prints per arm the RL steps' wall time (sum of time/step_s over steps 2.., the first holding
the compiles), how long the trainer waited for rollouts, the batches' staleness and pass rate,
and the ratio K / sync. Asserts nothing.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def arm(tmp: str, name: str, steps: int, k: int, extra: list) -> dict:
  cmd = [sys.executable, os.path.join(ROOT, "launch.py"), "--mode=rl",
         "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"), f"--config.workdir={tmp}",
         f"--config.name={name}", f"--config.envs.worlds_root={os.path.join(ROOT, 'runs/worlds')}",
         "--config.sft.steps=0", "--config.loop.eval_max_tasks=4", "--config.loop.progress=False",
         f"--config.train.steps={steps}", "--config.checkpoint.save_every=0",
         f"--config.loop.max_staleness={k}"] + [f"--config.{s}" for s in extra]
  t0 = time.monotonic()
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  wall = time.monotonic() - t0
  if out.returncode:
    sys.exit(f"arm {name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
  rows = [json.loads(l) for l in open(os.path.join(tmp, name, "metrics.jsonl"))]
  train = sorted((m for m in rows if m["phase"] == "train"), key=lambda m: m["step"])
  later = train[1:]
  return {"k": k, "process_s": wall,
          "steps_s": sum(m["time/step_s"] for m in later),
          "wait_s": sum(m["time/rollout_wait_s"] for m in later),
          "rollout_s": sum(m["time/rollout_s"] for m in later),
          "staleness": [m["rollout/staleness"] for m in train],
          "pass_rate": sum(m.get("mean_reward", 0.0) for m in train) / len(train)}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--k", type=int, default=1, help="max_staleness of the second arm")
  ap.add_argument("--set", action="append", default=[], help="key=value config override")
  args = ap.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    # Compiles land in the persistent cache; a first short run keeps them out of both arms.
    arm(tmp, "warm", 2, 0, args.set)
    sync = arm(tmp, "sync", args.steps, 0, args.set)
    ahead = arm(tmp, f"k{args.k}", args.steps, args.k, args.set)
  print(f"{'arm':<14} {'steps 2.. s':>11} {'waited s':>9} {'drawing s':>10} {'mean reward':>12} "
        f"staleness by step")
  for r in (sync, ahead):
    print(f"{'max_staleness=' + str(r['k']):<14} {r['steps_s']:>11.1f} {r['wait_s']:>9.1f} "
          f"{r['rollout_s']:>10.1f} {r['pass_rate']:>12.3f} {r['staleness']}")
  print(f"ratio (max_staleness={args.k} / sync) of the steps' wall time: "
        f"{ahead['steps_s'] / sync['steps_s']:.2f}")


if __name__ == "__main__":
  main()
