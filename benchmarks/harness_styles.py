"""The two harness styles side by side, and what confinement costs per call.

  python benchmarks/harness_styles.py [--tasks 48] [--concurrency 4] [--calls 40]

Figures:
  1. Episodes/s and pass rate of the scripted oracle through the real MCP gateways with
     harness.style=mcp (the app tools) and harness.style=shell (bash, read, write, edit, glob,
     grep over the world's folder) on the same tasks, every level; the ratio is what doing the
     work with commands and scripts costs against the app tools.
  2. Seconds per sandbox call: run_python("pass") and run_shell("true") confined (their own
     root, namespaces, the workspace copied in and back), beside the same boot unconfined
     (envs.sandbox.allow_unconfined, no namespaces) and a bare `python -c pass` subprocess.
Prints figures; asserts nothing. Figures: docs/results.md, "Harness styles".
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import base  # noqa: E402
from configs import tiny_cpu  # noqa: E402
from envs import sandbox  # noqa: E402
from envs import scripted_eval  # noqa: E402
from envs import tasks as tasks_lib  # noqa: E402
from envs import worlds  # noqa: E402


def styles_side_by_side(config, n_tasks: int, concurrency: int) -> None:
  envs_cfg = config.envs
  root = worlds.ensure_worlds(envs_cfg)
  split = tasks_lib.load_split(envs_cfg, "eval")
  # Every level, spread over the split's worlds: every k-th task.
  tasks = split[::max(1, len(split) // n_tasks)][:n_tasks]
  rows = {}
  for style in ("mcp", "shell"):
    t0 = time.monotonic()
    out = scripted_eval.run_tasks(tasks, envs_cfg, "oracle", "mcp", concurrency, root,
                                  style=style)
    wall = time.monotonic() - t0
    rows[style] = (len(out) / wall, sum(o.passed for o in out) / len(out), wall)
  print(f"scripted oracle, {len(tasks)} eval tasks (levels "
        f"{sorted(set(t.level for t in tasks))}), concurrency {concurrency}, gateway starts "
        f"included:")
  print(f"  {'style':6s} {'episodes/s':>10s} {'pass rate':>9s} {'wall s':>7s}")
  for style, (eps, rate, wall) in rows.items():
    print(f"  {style:6s} {eps:10.2f} {rate:9.3f} {wall:7.1f}")
  print(f"  shell / mcp episodes/s: {rows['shell'][0] / rows['mcp'][0]:.2f}")


def _per_call(fn, calls: int) -> float:
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def sandbox_cost(config, calls: int) -> None:
  confined = config.envs.sandbox
  unconfined = tiny_cpu.get_config().envs.sandbox
  unconfined.namespaces, unconfined.allow_unconfined = False, True
  with tempfile.TemporaryDirectory() as files:
    for i in range(20):   # a world's worth of small files to copy in and back
      with open(os.path.join(files, f"doc{i}.txt"), "w") as f:
        f.write("x" * 20_000)
    rows = [
        ("run_python, confined", lambda: sandbox.run_python("pass", files, confined, 100)),
        ("run_shell, confined", lambda: sandbox.run_shell("true", files, confined, 100)),
        ("run_python, unconfined", lambda: sandbox.run_python("pass", files, unconfined, 100)),
        ("python -c pass", lambda: subprocess.run([sys.executable, "-I", "-c", "pass"],
                                                  check=True)),
    ]
    sandbox.run_python("pass", files, confined, 100)   # the one-time probe, outside the figures
    print(f"sandbox, median of {calls} calls, 20 files of 20 kB in the workspace "
          f"(isolation: {sandbox.isolation(confined)}):")
    base = None
    for name, fn in rows:
      s = _per_call(fn, calls)
      base = base or s
      print(f"  {name:24s} {s * 1000:7.1f} ms  ({s / base:.2f}x run_python confined)")


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tasks", type=int, default=48)
  ap.add_argument("--concurrency", type=int, default=4)
  ap.add_argument("--calls", type=int, default=40)
  args = ap.parse_args(argv)
  print(f"cpus: {os.cpu_count()}")
  sandbox_cost(tiny_cpu.get_config(), args.calls)
  # The base config's splits hold every level (the tiny default's only level 1).
  styles_side_by_side(base.get_config(), args.tasks, args.concurrency)


if __name__ == "__main__":
  main()
