"""Ablation sweeps: one launch.py job per override set, then a table comparing them.

A sweep file (configs/sweeps/X.py) has `get_sweep(arg)` returning a list of dicts: dotted
config keys -> values, plus an optional `name` appended to the run name. Each job is the
same launch.py command line with `--config.<key>=<value>` added and `--sweep` removed, run
as its own process (a fresh JAX runtime, its own rollout server port, its own run directory
runs/<name>-<job>/). Keys are checked against the config before anything runs, so a typo
fails the whole sweep at once, and so does a job on a reporting world seed (configs/seeds.py:
sweeps choose settings, so they run on dev seeds), and so do two jobs that resolve to the same
config (a sweep key that changes nothing would run one job twice and report two results).
Before the jobs (and in a dry run, instead of them) each job's resolved differences from the
sweep's own config are printed: derived values that follow a swept key show there too
(configs/references.py). After the jobs, the summaries (runs/<job>/summary.json) are tabulated
to runs/sweeps/<sweep>-<config name>.md and printed.
"""
import copy
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time

from configs import record
from configs import seeds
from envs.eval_summary import paired_bootstrap_delta


def load_sweep(spec: str) -> list:
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise SystemExit(f"--sweep: no such file {path!r}")
  mod_spec = importlib.util.spec_from_file_location("sweep_file", path)
  mod = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(mod)
  jobs = mod.get_sweep(arg or None)
  if not jobs:
    raise SystemExit(f"--sweep: {path} lists no jobs")
  return [dict(j) for j in jobs]


def _check_keys(config, job: dict) -> None:
  for key in job:
    if key == "name":
      continue
    node = config
    parts = key.split(".")
    for p in parts[:-1]:
      if p not in node:
        raise SystemExit(f"--sweep: unknown config key {key!r}")
      node = node[p]
    if parts[-1] not in node:
      raise SystemExit(f"--sweep: unknown config key {key!r}")


def _overrides(config, argv: list, name: str, job: dict) -> dict:
  """Dotted key -> value of everything a job's command line sets over the sweep's own command
  line: the job's run name, the shared SFT directory (unless argv sets one), the job's keys."""
  out = {"name": name}
  if not any(a.startswith("--config.sft.dir=") for a in argv[1:]):
    # The arms share one SFT warm start (trained by the first job, reused by the others).
    out["sft.dir"] = os.path.join(config.workdir, config.name, "sft")
  out.update((k, v) for k, v in job.items() if k != "name")
  return out


def job_commands(config, jobs: list, argv: list) -> list:
  """(run name, job, argv) per job: argv minus --sweep/--dry_run, plus the job's overrides."""
  base = [a for a in argv[1:] if not a.startswith(("--sweep", "--dry_run", "--nodry_run"))]
  base = [a for a in base if not a.startswith("--config.name=")]
  out = []
  for i, job in enumerate(jobs):
    _check_keys(config, job)
    # A sweep chooses settings: it runs on dev seeds only (configs/seeds.py).
    seeds.check_tuning(job.get("envs.seed", config.envs.seed))
    name = f"{config.name}-{job.get('name', f'job{i}')}"
    args = [sys.executable, os.path.abspath(argv[0])] + base
    args += [f"--config.{k}={record.value_text(v)}"
             for k, v in _overrides(config, argv, name, job).items()]
    out.append((name, job, args))
  return out


def job_config(config, argv: list, name: str, job: dict):
  """The config job `name` resolves to: a copy of the sweep's `config` (references kept) with
  the job command line's overrides set, as its process sets them from the flags."""
  c = copy.deepcopy(config)
  for key, value in _overrides(config, argv, name, job).items():
    node = c
    *parents, last = key.split(".")
    for p in parents:
      node = node[p]
    node[last] = value
  return c


def resolved_jobs(config, cmds: list, argv: list) -> list:
  """(name, [(key, value, the sweep config's value)]) per job: the keys whose resolved values
  differ from the sweep's own config, run name and shared SFT directory left out. Stops, naming
  them, at two jobs that resolve to the same config (their overrides change nothing between
  them)."""
  out, seen = [], {}
  for name, job, _ in cmds:
    c = job_config(config, argv, name, job)
    diff = [d for d in record.differences(c, config) if d[0] not in ("name", "sft.dir")]
    key = repr(sorted((k, repr(v)) for k, v, _ in diff))
    if key in seen:
      shown = ", ".join(f"{k}={record.value_text(v)}" for k, v, _ in diff) or "none"
      raise SystemExit(f"--sweep: jobs {seen[key]} and {name} resolve to the same config; a key "
                       f"of theirs changes nothing (differences from the sweep's config: {shown})")
    seen[key] = name
    out.append((name, diff))
  return out


def _signed(d: float, ci=None) -> str:
  """A change, with its interval when there is one: `+0.018 [-0.018, +0.060]`."""
  return f"{d:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "")


def table(config, cmds: list) -> str:
  """Markdown table of the jobs' summaries (missing ones marked).

  The last column compares each job's after-RL pass@1 with the first job's on the same
  held-out tasks, as a paired bootstrap over tasks: the ablation's own readout."""
  keys = sorted({k for _, job, _ in cmds for k in job if k != "name"})
  first = cmds[0][0] if cmds else ""
  head = ["run"] + keys + ["pass@1 before", "pass@1 after (95% CI)", "delta (paired 95% CI)",
                           "reward before", "reward after", f"after vs {first} (paired 95% CI)"]
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  ref = None
  for i, (name, job, _) in enumerate(cmds):
    path = os.path.join(config.workdir, name, "summary.json")
    cells = [name] + [str(job.get(k, "")) for k in keys]
    try:
      with open(path, encoding="utf-8") as f:
        s = json.load(f)
      b, a = s["before_rl"], s["after_rl"]
      cells += [f"{b['pass_at_1']:.3f}",
                f"{a['pass_at_1']:.3f} [{a['pass_at_1_ci95'][0]:.3f}, {a['pass_at_1_ci95'][1]:.3f}]",
                _signed(a["pass_at_1"] - b["pass_at_1"], s.get("delta_pass_at_1_ci95")),
                f"{b['mean_reward']:.3f}",
                f"{a['mean_reward']:.3f}"]
      if i == 0:
        ref = a
        cells.append("-")
      elif ref is not None and "per_task_pass" in a and "per_task_pass" in ref:
        ci = paired_bootstrap_delta(ref["per_task_pass"], a["per_task_pass"],
                                    int(config.loop.bootstrap), int(config.seed))
        cells.append(_signed(a["pass_at_1"] - ref["pass_at_1"], ci))
      else:
        cells.append("")
    except (OSError, KeyError, ValueError):
      cells += ["(no summary)"] + [""] * 5
    rows.append("| " + " | ".join(cells) + " |")
  return "\n".join(rows) + "\n"


def style_table(config, cmds: list) -> str:
  """Markdown table of the held-out evals under each harness style (loop.eval_styles) of the
  jobs that ran them: what training under one style carried over to the other; "" if none."""
  rows, cross = [], False
  for name, job, _ in cmds:
    try:
      with open(os.path.join(config.workdir, name, "summary.json"), encoding="utf-8") as f:
        s = json.load(f)
    except (OSError, ValueError):
      continue
    trained = job.get("harness.style", config.harness.style)
    styles = {trained: s} if "before_rl" in s and "after_rl" in s else {}
    styles.update(s.get("by_style", {}))
    cross = cross or bool(s.get("by_style"))
    for style, r in styles.items():
      if "before_rl" in r and "after_rl" in r:
        b, a = r["before_rl"], r["after_rl"]
        rows.append(f"| {name} | {trained} | {style} | {b['pass_at_1']:.3f} | "
                    f"{a['pass_at_1']:.3f} | "
                    f"{_signed(a['pass_at_1'] - b['pass_at_1'], r.get('delta_pass_at_1_ci95'))} |")
  if not cross:
    return ""
  head = "| run | trained under | evaluated under | pass@1 before | pass@1 after | delta (paired 95% CI) |"
  return "\n".join([head, "|" + "---|" * 6] + rows) + "\n"


def run_sweep(spec: str, config, mode: str, argv: list, dry_run: bool = False) -> str:
  jobs = load_sweep(spec)
  cmds = job_commands(config, jobs, argv)
  resolved = resolved_jobs(config, cmds, argv)
  print(record.report(config), flush=True)
  print(f"sweep {spec}: {len(cmds)} jobs, mode {mode}", flush=True)
  for (name, _, args), (_, diff) in zip(cmds, resolved):
    print(f"  {name}: {shlex.join(args)}", flush=True)
    print("    resolves to: " + (", ".join(f"{k}={record.value_text(v)} (was "
                                          f"{record.value_text(w)})" for k, v, w in diff)
                                or "the sweep's config"), flush=True)
  if dry_run:
    return ""
  failed = []
  for name, _, args in cmds:
    t0 = time.monotonic()
    print(f"== {name}", flush=True)
    rc = subprocess.call(args)
    print(f"== {name}: exit {rc} after {time.monotonic() - t0:.0f}s", flush=True)
    if rc:
      failed.append(name)
  out = table(config, cmds)
  styles = style_table(config, cmds)
  out += ("\nHeld-out pass@1 by the tools it was evaluated with:\n\n" + styles) if styles else ""
  sweep_name = os.path.splitext(os.path.basename(spec.partition(":")[0]))[0]
  path = os.path.join(config.workdir, "sweeps", f"{sweep_name}-{config.name}.md")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(f"# sweep {spec} on {config.name} (--mode={mode})\n\n" + out)
  print(out + f"table written to {path}", flush=True)
  if failed:
    raise SystemExit(f"sweep: {len(failed)} job(s) failed: {failed}")
  return out
