"""Synchronous vs bounded-staleness RL: rollouts of the next k steps drawn while the trainer
works (loop.max_staleness, rl/rollout/prefetch.py), k = 0 (synchronous), 1 and 2.

  python launch.py --config=configs/tiny_cpu.py --mode=rl --sweep=configs/sweeps/staleness.py

The table compares held-out pass@1 after RL; each job's metrics.jsonl has the steps' wall time
(time/step_s), how long the trainer waited for rollouts (time/rollout_wait_s) and each batch's
staleness (rollout/staleness). benchmarks/staleness.py times the two ends side by side.
Results: docs/results.md, "Staleness sweep".
"""


def get_sweep(arg=None):
  del arg
  return [{"name": f"staleness_{k}", "loop.max_staleness": k} for k in (0, 1, 2)]
