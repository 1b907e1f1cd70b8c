"""benchmarks/donated_loop_params.py compiles each loop form with and without donation."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_loop_form_is_compiled_both_ways_and_unrolled_donation_saves_the_params():
  p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks/donated_loop_params.py"),
                      "--targets=cpu", "--layers=2", "--width=512", "--rows=16"],
                     capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert p.returncode == 0, p.stderr[-2000:]
  rows = json.loads(p.stdout.strip().splitlines()[-1])
  assert [r["loop"] for r in rows] == ["scan", "fori_loop", "scan behind a barrier",
                                       "scan, layers remat", "no loop (unrolled)"]
  for r in rows:
    assert r["total_mib_kept"] >= r["temp_mib_kept"] + r["params_mib"] > 0
    assert r["total_mib_donated"] > 0
  unrolled = rows[-1]   # no loop reads the weights: the update goes into the donated buffer
  assert unrolled["total_mib_donated"] <= unrolled["total_mib_kept"] - 0.9 * unrolled["params_mib"]
