"""--mode=pass_rates: the histogram and its refusal without a file to write."""
import os
import subprocess
import sys

from rl import pass_rates

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pass_rate_histogram_counts_tasks_by_passing_rollouts():
  hist = pass_rates.histogram({"a": 0.0, "b": 0.25, "c": 0.25, "d": 1.0}, 4)
  assert hist == {"0": 1, "1": 2, "2": 0, "3": 0, "4": 1}


def test_launch_pass_rates_mode_needs_a_file_to_write():
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), "--mode=pass_rates",
                        "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert "set it to a path" in out.stderr and "loop.train_pass_rates" in out.stderr
