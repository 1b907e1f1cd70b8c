"""The Task record: what an episode is asked, in which world, and how it is graded.

Defined apart from the generator (envs/tasks/__init__.py) so that the readers of task files
(envs/tasks/task_file.py, envs/tasks/archipelago.py) build Tasks without importing it.
"""
import dataclasses
import json

SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class Task:
  id: str                 # "<split>-<world_id>-<k>"
  split: str              # train | eval
  domain: str             # investment_banking | management_consulting | corporate_law
  world_id: str           # rendered world directory name under envs.worlds_root
  level: int              # 1 lookup, 2 chained lookups + arithmetic, 3 plus an app action; 0 none
  family: str             # generator family (xlsx_lookup, growth, email_figure, ...)
  prompt: str             # the user message
  input_files: dict       # {path under files/: text} placed in the world before the episode
  rubric: tuple           # criteria dicts (envs.tasks.rubric), primary objective first
  oracle_steps: tuple     # tool calls {name, args, expect} that solve the task
  oracle_answer: str      # the oracle's final answer
  # Tasks read from files (envs.source != "generated"; docs/own_environment.md) also carry:
  world_dir: str = ""     # the world's folder (absolute); "" = generated world_id under worlds_root
  expected_files: dict = dataclasses.field(default_factory=dict)  # {path: text} a reference output
  tags: tuple = ()        # free labels (e.g. an APEX-Agents job or the task's origin)
  weights: tuple = ()     # per-criterion reward weights (rubric order); () = equal

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  @classmethod
  def from_json(cls, s: str) -> "Task":
    d = json.loads(s)
    d["rubric"] = tuple(d["rubric"])
    d["oracle_steps"] = tuple(d["oracle_steps"])
    for k in ("tags", "weights"):
      if k in d:
        d[k] = tuple(d[k])
    return cls(**d)
