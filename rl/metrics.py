"""Where a run's figures go: runs/<name>/metrics.jsonl (always), TensorBoard (loop.tensorboard),
progress bars on the console (where the run's files go: rl/run_files.py)."""
from __future__ import annotations

import json
import os
import sys
import time

from absl import logging as absl_logging
import numpy as np
from tqdm import tqdm

from rl import distributed


class Metrics:
  """JSONL (always) and TensorBoard (config.loop.tensorboard) under the run directory. In a
  multi-process job only process 0 writes (every process holds the same figures)."""

  def __init__(self, run_dir: str, tensorboard: bool):
    self._f = self._tb = None
    if not distributed.is_writer():
      return
    os.makedirs(run_dir, exist_ok=True)
    self._f = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
    if tensorboard:
      try:
        # lazy: TensorBoard is optional; the JSONL has everything.
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
      except ImportError:
        self._tb = None

  def write(self, step: int, phase: str, metrics: dict) -> None:
    if self._f is None:
      return
    flat = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0 and _is_num(v)}
    self._f.write(json.dumps({"step": int(step), "phase": phase, "time": time.time(), **flat})
                  + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in flat.items():
        self._tb.add_scalar(tensorboard_tag(phase, k), v, step)
      self._tb.flush()

  def close(self):
    if self._f is not None:
      self._f.close()
    if self._tb is not None:
      self._tb.close()


def tensorboard_tag(phase: str, key: str) -> str:
  """`phase/key`, once: a key that already opens with its phase ("train/draws" from the
  step's metrics) keeps it as is, so no tag reads "train/train/draws"."""
  return key if key.startswith(phase + "/") else f"{phase}/{key}"


def _is_num(v) -> bool:
  try:
    float(v)
    return True
  except (TypeError, ValueError):
    return False


def progress_bar(config, total: int, desc: str):
  """A tqdm bar (off with loop.progress=False, and on every process but 0)."""
  # Redirected to a file, a bar that redraws ten times a second fills it: every 30 s then.
  interval = 0.1 if sys.stderr.isatty() else 30.0
  shown = bool(config.loop.progress) and distributed.is_writer()
  return tqdm(total=total, desc=desc, disable=not shown, dynamic_ncols=True, leave=True,
              mininterval=interval)


def quiet_logs():
  """Orbax and JetStream log every save and request at INFO; the console is for the bars."""
  if absl_logging.get_verbosity() <= absl_logging.INFO:
    absl_logging.set_verbosity(absl_logging.WARNING)
