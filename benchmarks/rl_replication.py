"""Does a setting's RL gain replicate? `make run`'s path on world seeds nobody tuned on.

    python benchmarks/rl_replication.py                               # make run's config
    python benchmarks/rl_replication.py --name=lr01 --config.optim.lr=0.1
    python benchmarks/rl_replication.py --seeds=dev                   # while tuning
    python benchmarks/rl_replication.py --name=lr01 --config.optim.lr=0.1 --against=default

For each world seed (default: the reporting seeds of configs/seeds.py) runs `launch.py
--mode=rl --config=configs/tiny_cpu.py` with config.envs.seed set (its own worlds under
runs/worlds_s<seed>, its own run directory runs/replication-<name>-s<seed>) and the `--config.*`
overrides given here, then prints per seed and pooled over the seeds: held-out pass@1 before and
after RL with 95% bootstrap intervals, and the paired change with its interval. The pooled row
resamples the tasks of all seeds together (each seed's tasks are distinct), so its interval is
over tasks, given these runs; "every seed positive" is the check across runs.

`--against=ARM` also sets this arm's pass@1 after RL beside arm ARM's (already run on the same
seeds), paired per task: at equal rollouts from the same SFT start, which arm RL left better.

Each seed's SFT warm start is trained once and reused by every arm (`--name`) run on that seed
(runs/replication-s<seed>-sft). A seed whose run directory already holds a summary from the same
command is read, not run again; the table goes to runs/replication/<name>.md and .json.

Cost: one `make run` per seed without the install (8-14 minutes each on 2 cores; the first run
on a seed also renders its worlds, 1-2 minutes). Asserts nothing.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import seeds as seed_sets  # noqa: E402
from envs.eval_summary import bootstrap_ci  # noqa: E402
from envs.eval_summary import paired_bootstrap_delta  # noqa: E402

RESAMPLES = 10_000


def parse_seeds(spec: str) -> tuple:
  if spec == "reporting":
    return seed_sets.REPORTING_SEEDS
  if spec == "dev":
    return seed_sets.DEV_SEEDS
  try:
    return tuple(int(s) for s in spec.split(",") if s)
  except ValueError:
    raise SystemExit(f"--seeds={spec!r}: use reporting | dev | a comma-separated list") from None


def seed_command(seed: int, name: str, overrides: list, workdir: str) -> list:
  return [sys.executable, os.path.join(ROOT, "launch.py"), "--mode=rl",
          "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"),
          f"--config.workdir={workdir}", f"--config.name=replication-{name}-s{seed}",
          f"--config.envs.seed={seed}",
          f"--config.envs.worlds_root={os.path.join(ROOT, seed_sets.worlds_root(seed))}",
          f"--config.sft.dir={os.path.join(workdir, f'replication-s{seed}-sft')}",
          "--config.loop.progress=False"] + list(overrides)


def run_seed(seed: int, name: str, overrides: list, workdir: str) -> dict:
  """The seed's summary.json, running it first unless a finished run of this command exists."""
  cmd = seed_command(seed, name, overrides, workdir)
  rdir = os.path.join(workdir, f"replication-{name}-s{seed}")
  summary_path, cmd_path = os.path.join(rdir, "summary.json"), os.path.join(rdir, "command.json")
  saved = None
  if os.path.isfile(cmd_path):
    with open(cmd_path) as f:
      saved = json.load(f)
  if saved == cmd[1:] and os.path.isfile(summary_path):
    print(f"seed {seed}: reading the finished run in {rdir}", flush=True)
    with open(summary_path) as f:
      return json.load(f)
  if saved is not None and saved != cmd[1:] and os.path.isdir(os.path.join(rdir, "checkpoints")):
    raise SystemExit(f"{rdir} holds a run of another command; use another --name")
  os.makedirs(rdir, exist_ok=True)
  with open(cmd_path, "w") as f:
    json.dump(cmd[1:], f)
  t0 = time.monotonic()
  print(f"seed {seed}: {' '.join(cmd[1:])}", flush=True)
  with open(os.path.join(rdir, "replication.log"), "w") as log:
    rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  if rc:
    with open(os.path.join(rdir, "replication.log")) as f:
      raise SystemExit(f"seed {seed} failed (exit {rc}):\n{f.read()[-4000:]}")
  print(f"seed {seed}: done in {time.monotonic() - t0:.0f} s", flush=True)
  with open(summary_path) as f:
    return json.load(f)


def row(label: str, before: dict, after: dict) -> dict:
  """Figures of one row from per-task pass rates (task id -> rate) before and after."""
  ids = sorted(set(before) & set(after))
  b = np.array([before[i] for i in ids])
  a = np.array([after[i] for i in ids])
  return {"seed": label, "tasks": len(ids), "before": float(b.mean()),
          "before_ci95": bootstrap_ci(b, RESAMPLES), "after": float(a.mean()),
          "after_ci95": bootstrap_ci(a, RESAMPLES), "delta": float((a - b).mean()),
          "delta_ci95": paired_bootstrap_delta(before, after, RESAMPLES)}


def finished_summary(workdir: str, name: str, seed: int) -> dict:
  """summary.json of arm `name`'s finished run on `seed`; exits naming the run when missing."""
  path = os.path.join(workdir, f"replication-{name}-s{seed}", "summary.json")
  if not os.path.isfile(path):
    raise SystemExit(f"arm {name!r} has no finished run on seed {seed} ({path}); run it first: "
                     f"python benchmarks/rl_replication.py --name={name} <its overrides>")
  with open(path) as f:
    return json.load(f)


def seed_rows(pairs: list) -> list:
  """Rows of (seed, before, after) per-task pass rates, one per seed, and with several seeds a
  pooled row over all their tasks (each seed's tasks are distinct: ids prefixed by the seed)."""
  rows, pooled_before, pooled_after = [], {}, {}
  for seed, before, after in pairs:
    rows.append(row(str(seed), before, after))
    pooled_before.update({f"{seed}/{k}": v for k, v in before.items()})
    pooled_after.update({f"{seed}/{k}": v for k, v in after.items()})
  if len(pairs) > 1:
    rows.append(row("pooled", pooled_before, pooled_after))
  return rows


def against_rows(ours: dict, theirs: dict) -> list:
  """This arm against another at equal rollouts, from their summaries per seed (the same SFT
  start): rows whose "before" is the other arm's pass@1 after RL and "after" is this arm's, so
  "delta" is the paired change of this arm over the other, per seed and pooled."""
  return seed_rows([(seed, theirs[seed]["after_rl"]["per_task_pass"],
                     ours[seed]["after_rl"]["per_task_pass"]) for seed in ours])


def by_family(arms: dict) -> dict:
  """family -> {"tasks", "start", <arm>: pass@1 after RL} pooled over the seeds' eval tasks,
  from `arms` (name -> {seed: summary}; "start": before RL, the SFT start every arm shares,
  read from the first arm's runs)."""
  out = {}
  for i, (name, summaries) in enumerate(arms.items()):
    for s in summaries.values():
      evals = (("start", s["before_rl"]),) if i == 0 else ()
      for col, ev in evals + ((name, s["after_rl"]),):
        for fam, f in ev["by_family"].items():
          cell = out.setdefault(fam, {}).setdefault(col, [0, 0.0])
          cell[0] += f["n_tasks"]
          cell[1] += f["pass_at_1"] * f["n_tasks"]
  return {fam: {"tasks": cols["start"][0],
                **{c: passed / max(n, 1) for c, (n, passed) in cols.items()}}
          for fam, cols in sorted(out.items())}


def family_table(fams: dict, names: tuple) -> str:
  out = ["| family | tasks | start | " + " | ".join(f"after RL, {n}" for n in names) + " |",
         "|---|---|---|" + "---|" * len(names)]
  for fam, r in fams.items():
    out.append(f"| {fam} | {r['tasks']} | {r['start']:.3f} | "
               + " | ".join(f"{r[n]:.3f}" for n in names) + " |")
  return "\n".join(out) + "\n"


def table(rows: list, columns=("pass@1 before", "pass@1 after")) -> str:
  out = [f"| world seed | tasks | {columns[0]} (95% CI) | {columns[1]} (95% CI) | "
         "paired change (95% CI) |", "|---|---|---|---|---|"]
  for r in rows:
    out.append(f"| {r['seed']} | {r['tasks']} | {r['before']:.3f} [{r['before_ci95'][0]:.3f}, "
               f"{r['before_ci95'][1]:.3f}] | {r['after']:.3f} [{r['after_ci95'][0]:.3f}, "
               f"{r['after_ci95'][1]:.3f}] | {r['delta']:+.3f} [{r['delta_ci95'][0]:+.3f}, "
               f"{r['delta_ci95'][1]:+.3f}] |")
  return "\n".join(out) + "\n"


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seeds", default="reporting", help="reporting | dev | 101,102,...")
  ap.add_argument("--name", default="default", help="the arm's name (run directories, table)")
  ap.add_argument("--workdir", default=os.path.join(ROOT, "runs"))
  ap.add_argument("--against", default="",
                  help="another arm, already run on the same seeds: also print this arm's "
                       "pass@1 after RL against that arm's, paired per task")
  args, rest = ap.parse_known_args()
  bad = [a for a in rest if not a.startswith("--config.")]
  if bad:
    raise SystemExit(f"unknown arguments {bad}; config overrides are --config.<key>=<value>")
  for a in rest:
    if a.startswith(("--config.envs.seed=", "--config.envs.worlds_root=", "--config.name=",
                     "--config.workdir=")):
      raise SystemExit(f"{a.split('=')[0]} is set per seed by this script; use --seeds/--name")
  seeds = parse_seeds(args.seeds)
  summaries = {seed: run_seed(seed, args.name, rest, args.workdir) for seed in seeds}
  rows = seed_rows([(seed, s["before_rl"]["per_task_pass"], s["after_rl"]["per_task_pass"])
                    for seed, s in summaries.items()])
  text = (f"RL replication, arm {args.name!r} (overrides: {' '.join(rest) or 'none'}), "
          f"world seeds {', '.join(map(str, seeds))}:\n\n" + table(rows))
  positive = all(r["delta"] > 0 for r in rows if r["seed"] != "pooled")
  pooled = rows[-1]
  text += (f"\nevery seed's change positive: {positive}; the pooled paired interval excludes "
           f"zero: {pooled['delta_ci95'][0] > 0 or pooled['delta_ci95'][1] < 0}\n")
  out = {"overrides": rest, "seeds": list(seeds), "rows": rows}
  if args.against:
    theirs = {seed: finished_summary(args.workdir, args.against, seed) for seed in seeds}
    vs = against_rows(summaries, theirs)
    arms = (args.against, args.name)
    fams = by_family({args.against: theirs, args.name: summaries})
    out["against"] = {"arm": args.against, "rows": vs, "by_family": fams}
    text += (f"\nArm {args.name!r} against arm {args.against!r}, pass@1 after RL, paired per "
             f"task:\n\n" + table(vs, (f"{args.against}", f"{args.name}"))
             + "\nBy task family, pooled over the seeds:\n\n" + family_table(fams, arms))
  print("\n" + text, flush=True)
  out_dir = os.path.join(args.workdir, "replication")
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, f"{args.name}.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out_dir, f"{args.name}.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
