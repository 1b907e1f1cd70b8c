"""Run directories for the run-record tests (tests/rl/test_run_record.py, tests/test_launch_run_dir.py)."""
import hashlib
import os

from rl import run_files
from rl import run_record


def file_digests(directory) -> dict:
  """Relative path -> sha256 of every file under `directory`."""
  out = {}
  for dirpath, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return out


def started_run_dir(config, checkpoint_step: int = 2) -> str:
  """`config`'s run directory as --mode=rl leaves it after some steps: the record written at
  its start (by the check launch.py runs), metrics, a summary, a checkpoint, SFT params."""
  run_record.guard(config, "rl")
  rdir = run_files.run_dir(config)
  for rel in ("metrics.jsonl", "summary.json", f"checkpoints/{checkpoint_step}/state",
              "sft/4/params"):
    os.makedirs(os.path.dirname(os.path.join(rdir, rel)), exist_ok=True)
    with open(os.path.join(rdir, rel), "w", encoding="utf-8") as f:
      f.write(rel)
  return rdir
