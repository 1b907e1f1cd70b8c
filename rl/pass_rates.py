"""--mode=pass_rates: the pass rate of the policy RL would start from, task by task, on train
tasks, for offline difficulty filtering (`loop.train_pass_range`).

  python launch.py --config=configs/tiny_cpu.py --mode=pass_rates \
      --config.loop.train_pass_rates=runs/tiny_cpu/train_pass_rates.json \
      [--config.loop.pass_rate_samples=4] [--config.loop.pass_rate_max_tasks=600]

The policy is the one `--mode=rl` with the same config starts from: the SFT result in
runs/<name>/sft (trained first when missing) or train.init_from. Each of the first
`loop.pass_rate_max_tasks` train tasks of loop.levels and loop.families is rolled out
`loop.pass_rate_samples` times at the RL temperature through the same harness, worlds and
JetStream server as RL, with episode seeds no RL step or eval uses. Writes `loop.train_pass_rates`:
{"pass_rate": {task id: rate}, "samples_per_task", "temperature", "init_from", "sft_steps",
"n_tasks", "histogram"}, and prints how many tasks pass in 0, 1, ..., k of their rollouts.
"""
import collections
import os
import time

from envs import eval_summary
from envs import judge as judge_lib
from envs import worlds
from envs.tasks import task_file
from rl import judge_server
from rl.metrics import quiet_logs
from rl.run_files import write_json
from rl.rollout import capacity
from rl.rollout.draw import run_pool
from rl.rollout.draw import served_policy
from rl.sft import start_params
from rl.sft import warm_start
from rl.task_data import make_episodes
from rl.task_data import select_tasks

# Added to every episode seed: RL step s adds 104729 * (s + 1), the held-out eval 7919 * (s + 1).
_SEED_OFFSET = 1_000_003


def measure(config, tasks, samples: int) -> dict:
  """task id -> pass rate over `samples` rollouts of the starting policy."""
  if not config.envs.judge.checkpoint:  # else the judge served below fills the endpoint
    judge_lib.require(tasks, config.envs.judge)  # before SFT and rollouts
  if task_file.needs_generated_worlds(tasks):  # tasks from files may bring their own worlds
    worlds.ensure_worlds(config.envs)
  warm_start(config)  # the SFT the RL run would start from, trained unless saved
  with judge_server.judged(config) as judged_cfg, served_policy(
      judged_cfg, start_params(config)) as (_, cfg, pool):
    eps = make_episodes(tasks, cfg, samples, seed_offset=_SEED_OFFSET)
    results = run_pool(pool, eps, cfg, "train pass rates")
  return eval_summary.summarize(results, tasks, resamples=1)["per_task_pass"]


def histogram(rates: dict, samples: int) -> dict:
  """Tasks by number of passing rollouts, "0".."samples"."""
  counts = collections.Counter(int(round(r * samples)) for r in rates.values())
  return {str(k): counts.get(k, 0) for k in range(samples + 1)}


def main(config, flags=None):
  del flags
  capacity.check_context(config)
  quiet_logs()
  out_path, samples = config.loop.train_pass_rates, int(config.loop.pass_rate_samples)
  if not out_path:
    raise ValueError("--mode=pass_rates writes config.loop.train_pass_rates: set it to a path")
  if samples < 2:
    raise ValueError(f"loop.pass_rate_samples must be at least 2 (one rollout cannot tell a "
                     f"task that sometimes passes from one that always does), got {samples}")
  tasks = select_tasks(config, "train", config.loop.levels,
                       int(config.loop.pass_rate_max_tasks), tuple(config.loop.families))
  t0 = time.monotonic()
  rates = measure(config, tasks, samples)
  hist = histogram(rates, samples)
  out = {"pass_rate": rates, "samples_per_task": samples,
         "temperature": float(config.rl.temperature), "init_from": config.train.init_from,
         "sft_steps": int(config.sft.steps), "n_tasks": len(rates), "histogram": hist}
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  write_json(out_path, out)
  some = sum(v for k, v in hist.items() if k not in ("0", str(samples)))
  print(f"{len(rates)} train tasks x {samples} rollouts in {time.monotonic() - t0:.0f}s; tasks "
        f"by passing rollouts {hist}: {some} pass sometimes; written to {out_path}", flush=True)
  return out
