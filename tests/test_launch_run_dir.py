"""launch.py on a run directory that holds a run of another config: it refuses before writing
anything, on one process and on every process of a pod alike (rl/run_record.py; the check's
cases are in tests/rl/test_run_record.py)."""
import hashlib
import os
import subprocess
import sys

from configs import tiny_cpu
from rl import run_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import local_pod  # noqa: E402  (scripts/ is not a package)


def _files(directory) -> dict:
  out = {}
  for dirpath, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(dirpath, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return out


def _run_dir(workdir) -> str:
  """tiny_cpu's run directory under `workdir` as --mode=rl leaves it: the record written at its
  start (by the check launch.py runs), metrics, a checkpoint, SFT params."""
  c = tiny_cpu.get_config()
  c.workdir = str(workdir)
  run_record.guard(c, "rl")
  rdir = os.path.join(workdir, "tiny_cpu")
  for rel in ("metrics.jsonl", "summary.json", "checkpoints/12/state", "sft/4/params"):
    os.makedirs(os.path.dirname(os.path.join(rdir, rel)), exist_ok=True)
    with open(os.path.join(rdir, rel), "w", encoding="utf-8") as f:
      f.write(rel)
  return rdir


def _cmd(workdir) -> list:
  return [sys.executable, os.path.join(ROOT, "launch.py"), "--mode=rl",
          "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"), f"--config.workdir={workdir}",
          "--config.optim.lr=0.5", "--config.train.steps=14"]


def test_launch_refuses_an_unsafe_change_naming_it_and_writes_nothing(tmp_path):
  rdir = _run_dir(tmp_path / "runs")
  before = _files(tmp_path)
  out = subprocess.run(_cmd(tmp_path / "runs"), cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  lines = out.stderr.splitlines()
  assert lines[0] == (f"launch.py: {rdir} holds a run of another config; nothing was written. "
                      "Keys that differ (recorded -> this command):")
  assert "  optim.lr: 0.2 -> 0.5" in lines
  assert "train.steps: 12 -> 14 (extends the run)" in out.stderr   # safe, named as such
  assert "--config.name=tiny_cpu-2" in lines[-1] and "--config.resume=changed" in lines[-1]
  assert "Traceback" not in out.stderr
  assert _files(tmp_path) == before


def test_every_process_of_a_pod_refuses_alike_and_none_writes(tmp_path):
  _run_dir(tmp_path / "runs")
  before = _files(tmp_path / "runs")
  log_dir = str(tmp_path / "logs")
  procs = local_pod.start([_cmd(tmp_path / "runs")] * 2, 1, log_dir, console=False)
  assert local_pod.wait(procs, 60) == 2
  logs = []
  for i in range(2):
    with open(os.path.join(log_dir, f"process_{i}.log"), encoding="utf-8") as f:
      logs.append(f.read())
  refusals = [[l for l in log.splitlines() if l.startswith(("launch.py: ", "  optim.lr: "))]
              for log in logs]
  assert refusals[0] == refusals[1] and "  optim.lr: 0.2 -> 0.5" in refusals[0], logs[1][-3000:]
  assert [p.returncode for p in procs] == [2, 2]
  assert _files(tmp_path / "runs") == before
