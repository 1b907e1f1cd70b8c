"""The tasks a run uses: the train pool RL samples from, the held-out eval tasks, the episodes
built from them, and the checkpointed order in which RL draws train tasks.

    train = train_pool(config)                                   # loop.levels / families / pass range
    held_out = select_tasks(config, "eval", config.loop.eval_levels, config.loop.eval_max_tasks)
    stream = TaskStream(train, config.seed, position)             # position is checkpointed
    episodes = make_episodes(stream.take(p), config, samples_per_task=g)
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional, Sequence

import grain.python as grain

from envs import tasks as tasks_lib
from envs.harness.episodes import task_episodes
from envs.harness.tool_subset import ToolSubsetSpec


def select_tasks(config, split: str, levels: Sequence[int], max_tasks: int = 0,
                 families: Sequence[str] = ()) -> list:
  """The tasks of `split` (envs.tasks.load_tasks: generated, or those of envs.tasks_file) whose
  level is in `levels` (tasks without a level, level 0, always) and family in `families`, when
  given, in the split's fixed order."""
  out = [t for t in tasks_lib.load_tasks(config.envs, split)
         if t.level in tuple(levels) or not t.level]
  if families:
    known = sorted({t.family for t in out})
    unknown = sorted(set(families) - set(known))
    if unknown:
      raise ValueError(f"loop.families names {unknown}, not task families of the {split} split "
                       f"at levels {tuple(levels)}; they are {known}")
    out = [t for t in out if t.family in tuple(families)]
  return out[:max_tasks] if max_tasks else out


def read_pass_rates(path: str) -> dict:
  """task id -> measured pass rate, from the JSON --mode=pass_rates writes."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"loop.train_pass_rates={path!r} is not a file (--mode=pass_rates "
                            "writes one)")
  with open(path, encoding="utf-8") as f:
    try:
      d = json.load(f)
      return {str(k): float(v) for k, v in d["pass_rate"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"loop.train_pass_rates={path!r} is not a pass-rate file of "
                       f"--mode=pass_rates ({type(e).__name__}: {e})") from e


def train_pool(config) -> list:
  """The train tasks RL samples from: loop.levels and loop.families of the train split, then,
  with loop.train_pass_range = (lo, hi), only the tasks whose pass rate measured under the
  starting policy (loop.train_pass_rates) lies in [lo, hi]. Tasks the policy always or never
  passes give groups without signal; dropping them beforehand (offline difficulty filtering)
  puts a step's rollouts on tasks that teach. Tasks the file does not rate are dropped too."""
  tasks = select_tasks(config, "train", config.loop.levels, families=tuple(config.loop.families))
  rng = tuple(config.loop.train_pass_range)
  if not rng:
    return tasks
  if len(rng) != 2 or not 0.0 <= float(rng[0]) <= float(rng[1]) <= 1.0:
    raise ValueError(f"loop.train_pass_range must be () or (lo, hi) with 0 <= lo <= hi <= 1, "
                     f"got {rng}")
  if not config.loop.train_pass_rates:
    raise ValueError("loop.train_pass_range is set but loop.train_pass_rates names no file")
  rates = read_pass_rates(config.loop.train_pass_rates)
  lo, hi = float(rng[0]), float(rng[1])
  kept = [t for t in tasks if t.id in rates and lo <= rates[t.id] <= hi]
  rated = sum(t.id in rates for t in tasks)
  if not kept:
    raise ValueError(f"no train task has a measured pass rate in [{lo}, {hi}] "
                     f"({rated} of {len(tasks)} rated in {config.loop.train_pass_rates})")
  print(f"train pool: {len(kept)} of {len(tasks)} train tasks ({rated} rated) with a measured "
        f"pass rate in [{lo:g}, {hi:g}]", flush=True)
  return kept


def make_episodes(tasks, config, samples_per_task: int = 1, first_group: int = 0,
                  seed_offset: int = 0, temperature: Optional[float] = None) -> list:
  """Harness episodes for `tasks` (one group per task), worlds restricted to loop.tools;
  `temperature` None = the loop's (rl.temperature)."""
  eps = task_episodes(tasks, config, samples_per_task, first_group,
                      worlds_root=config.envs.worlds_root)
  tools, schema = tuple(config.loop.tools), str(config.loop.tool_schema)
  return [dataclasses.replace(e, world=ToolSubsetSpec(e.world, tools, schema),
                              seed=e.seed + seed_offset, temperature=temperature) for e in eps]


class TaskStream:
  """Shuffled, epoch-aware task order from a grain IndexSampler; `position` is checkpointed."""

  def __init__(self, tasks, seed: int, position: int = 0):
    self.tasks = tasks
    self.sampler = grain.IndexSampler(num_records=len(tasks), num_epochs=None, shuffle=True,
                                      seed=seed, shard_options=grain.NoSharding())
    self.position = int(position)

  def take(self, n: int) -> list:
    out = [self.tasks[self.sampler[self.position + i].record_key] for i in range(n)]
    self.position += n
    return out

  @property
  def epoch(self) -> float:
    return self.position / len(self.tasks)
