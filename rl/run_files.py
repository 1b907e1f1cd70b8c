"""Where a run's files go (runs/<name>, its SFT directory) and how a JSON file is written whole
(summary.json, pass-rate files)."""
import json
import os

from rl import distributed


def run_dir(config) -> str:
  """runs/<name>: everything one run writes."""
  return os.path.join(config.workdir, config.name)


def starts_from_sft(config) -> bool:
  """Whether the RL job starts from SFT params (loop.sft_first, with sft.steps > 0), which live
  in `sft_dir`."""
  return bool(config.loop.sft_first and config.sft.steps)


def sft_dir(config) -> str:
  """Where SFT params are saved: sft.dir, default runs/<name>/sft."""
  return config.sft.dir or os.path.join(run_dir(config), "sft")


def write_json(path: str, obj) -> None:
  """`obj` as JSON at `path`, written to a temporary file and renamed: never half a file. In a
  multi-process job only process 0 writes."""
  if not distributed.is_writer():
    return
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)
