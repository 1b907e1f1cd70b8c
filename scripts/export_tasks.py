"""Writes a config's tasks to a JSONL task file (the format of envs/tasks/task_file.py).

  python scripts/export_tasks.py --config=configs/tiny_cpu.py --out=tasks.jsonl [--split=eval]

The tasks are those `envs.tasks.load_tasks` gives for the config (the generated tasks, or those
of envs.tasks_file), train then eval unless --split names one. Read back with
`--config.envs.tasks_file=tasks.jsonl`, they are the same Task objects (docs/own_environment.md).
"""
import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs import tasks as tasks_lib  # noqa: E402
from envs.tasks import task_file  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py",
                                          "Config file, optionally with `:arg`.")
_OUT = flags.DEFINE_string("out", None, "JSONL task file to write.", required=True)
_SPLIT = flags.DEFINE_enum("split", None, list(tasks_lib.SPLITS),
                           "Only this split (default: train, then eval).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  envs_cfg = _CONFIG.value.envs
  splits = (_SPLIT.value,) if _SPLIT.value else tasks_lib.SPLITS
  tasks = [t for s in splits for t in tasks_lib.load_tasks(envs_cfg, s)]
  task_file.write_jsonl(tasks, _OUT.value)
  print(f"{len(tasks)} tasks ({', '.join(splits)}) written to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
