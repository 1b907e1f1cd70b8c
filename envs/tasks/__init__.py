"""Tasks: generated per world, split into train and eval with no shared world and no shared prompt.

  tasks = load_split(config.envs, "eval")     # [Task], deterministic
  tasks = load_tasks(config.envs, "eval")     # the configured source: generated, or envs.tasks_file
  src = TaskSource(tasks)                     # grain RandomAccessDataSource of JSON records
  result = grade(task, final_answer, before_dir, after_dir, config.envs)

A Task carries its oracle (`oracle_steps`: tool calls {name, args, expect}, `oracle_answer`) so
scripted policies and harness tests can replay a known-good episode through any transport.
"""
import random

from envs import worlds
from envs.tasks import families
from envs.tasks import task_file
from envs.tasks.rubric import GradeResult, CriterionResult, JudgeUnavailable, grade  # noqa: F401
from envs.tasks.task import SPLITS, Task  # noqa: F401


def split_worlds(envs_cfg) -> dict:
  """split -> {domain: [world ids]}: the first eval_worlds_per_domain worlds go to eval."""
  out = {s: {d: [] for d in worlds.DOMAINS} for s in SPLITS}
  for wid, spec in sorted(worlds.all_specs(envs_cfg).items()):
    s = "eval" if spec["index"] < envs_cfg.eval_worlds_per_domain else "train"
    out[s][spec["domain"]].append(wid)
  return out


def _even(n: int, k: int) -> list:
  return [n // k + (1 if i < n % k else 0) for i in range(k)]


def load_split(envs_cfg, split: str) -> list:
  """All tasks of a split, in a fixed order (domain, world, k)."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  specs = worlds.all_specs(envs_cfg)
  by_domain = split_worlds(envs_cfg)[split]
  doms = worlds.DOMAINS
  per_domain = (_even(envs_cfg.train_tasks, len(doms)) if split == "train"
                else [envs_cfg.eval_tasks_per_domain] * len(doms))
  tasks = []
  for d, n_dom in zip(doms, per_domain):
    wids = by_domain[d]
    if not wids:
      raise ValueError(f"split {split!r} has no {d} worlds (see envs.eval_worlds_per_domain)")
    for wid, n in zip(wids, _even(n_dom, len(wids))):
      spec = specs[wid]
      rng = random.Random(spec["seed"] ^ 0x7A5C)
      for k, c in enumerate(families.generate(spec, n, envs_cfg.level_weights, rng)):
        tasks.append(Task(id=f"{split}-{wid}-{k:03d}", split=split, domain=d, world_id=wid,
                          level=c["level"], family=c["family"], prompt=c["prompt"],
                          input_files=dict(c["input_files"]), rubric=tuple(c["rubric"]),
                          oracle_steps=tuple(c["oracle"]["steps"]),
                          oracle_answer=c["oracle"]["answer"]))
  return tasks


def load_tasks(envs_cfg, split: str) -> list:
  """The tasks of a split from the configured source, the one entry point of every caller:
  envs.tasks_file = "" gives the generated tasks (exactly `load_split`); otherwise the tasks of
  that file (a JSONL task file or an APEX-Agents/Archipelago folder; envs.tasks_format) whose
  split is `split`, in file order (envs/tasks/task_file.py, docs/own_environment.md)."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if not envs_cfg.tasks_file:
    return load_split(envs_cfg, split)
  return task_file.split_of(task_file.file_tasks(envs_cfg), split, envs_cfg.tasks_file)


def uses_generated_worlds(envs_cfg) -> bool:
  """Whether the configured tasks (either split) need the generated worlds rendered
  (worlds.ensure_worlds): always for the generated tasks, else when a file task names one."""
  return not envs_cfg.tasks_file or task_file.needs_generated_worlds(task_file.file_tasks(envs_cfg))

class TaskSource:
  """A grain RandomAccessDataSource: records are Task JSON strings (decode with Task.from_json)."""

  def __init__(self, tasks: list):
    self._records = [t.to_json() for t in tasks]

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, i: int) -> str:
    return self._records[i]

  def __repr__(self) -> str:
    return f"TaskSource({len(self)} tasks)"


def data_loader(envs_cfg, split: str, seed: int, num_epochs: int = 1, shuffle: bool = True):
  """A grain DataLoader over a split yielding Task objects (shuffled per epoch with `seed`)."""
  import grain.python as grain  # lazy: ~4 s of imports, for data_loader's callers only
  src = TaskSource(load_split(envs_cfg, split))
  sampler = grain.IndexSampler(num_records=len(src), num_epochs=num_epochs, shuffle=shuffle,
                               seed=seed, shard_options=grain.NoSharding())

  class _Decode(grain.MapTransform):
    def map(self, rec):
      return Task.from_json(rec)
  return grain.DataLoader(data_source=src, sampler=sampler, operations=[_Decode()],
                          worker_count=0)
