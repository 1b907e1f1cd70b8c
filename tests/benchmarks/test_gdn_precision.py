"""benchmarks/gdn_precision.py runs and reports each precision against "highest"."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_precision_is_timed_and_on_the_cpu_equals_highest():
  p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks/gdn_precision.py"),
                      "--seq=96", "--heads=2", "--dk=16", "--dv=8", "--chunk=32", "--rounds=2",
                      "--iters=1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert p.returncode == 0, p.stderr[-2000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  assert set(out["precisions"]) == {"highest", "high", "default"}
  for row in out["precisions"].values():
    assert row["ms"] > 0 and len(row["speedup_range"]) == 2
    assert row["output_error"] == 0 and set(row["grad_error"].values()) == {0.0}


def test_both_scans_are_timed_against_the_default_and_agree():
  p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks/gdn_precision.py"),
                      "--seq=96", "--heads=2", "--dk=16", "--dv=8", "--chunk=32", "--rounds=2",
                      "--iters=1", "--scans=outputs,states", "--precisions=highest"],
                     capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert p.returncode == 0, p.stderr[-2000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  assert set(out["variants"]) == {"outputs/highest", "states/highest"}
  row = out["variants"]["states/highest"]
  assert row["ms"] > 0 and row["output_error"] < 1e-5 and max(row["grad_error"].values()) < 1e-5
