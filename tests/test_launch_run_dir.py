"""launch.py on a run directory that holds a run of another config: it refuses before writing
anything, on one process and on every process of a pod alike (rl/run_record.py; the check's
cases are in tests/rl/test_run_record.py)."""
import os
import subprocess
import sys

from configs import tiny_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "tests", "rl"))

import local_pod  # noqa: E402  (scripts/ is not a package)
import run_dir_utils  # noqa: E402  (nor tests/)


def _started_run_dir(workdir) -> str:
  """tiny_cpu's run directory under `workdir` as --mode=rl leaves it after 12 steps."""
  c = tiny_cpu.get_config()
  c.workdir = str(workdir)
  return run_dir_utils.started_run_dir(c, checkpoint_step=12)


def _cmd(workdir) -> list:
  return [sys.executable, os.path.join(ROOT, "launch.py"), "--mode=rl",
          "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"), f"--config.workdir={workdir}",
          "--config.optim.lr=0.5", "--config.train.steps=14"]


def test_launch_refuses_an_unsafe_change_naming_it_and_writes_nothing(tmp_path):
  rdir = _started_run_dir(tmp_path / "runs")
  before = run_dir_utils.file_digests(tmp_path)
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
  assert run_dir_utils.file_digests(tmp_path) == before


def test_every_process_of_a_pod_refuses_alike_and_none_writes(tmp_path):
  _started_run_dir(tmp_path / "runs")
  before = run_dir_utils.file_digests(tmp_path / "runs")
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
  assert run_dir_utils.file_digests(tmp_path / "runs") == before
