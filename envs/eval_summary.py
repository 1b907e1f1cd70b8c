"""One summary of an evaluation, used by every path that evaluates (the RL run's held-out evals,
`--mode=eval`, `--mode=pass_rates`): pass@1 and mean reward over tasks with percentile bootstrap
intervals, outcome counts, pass@1 per task family, and the lines that print them.

`--mode=eval` (envs/scripted_eval.py, envs/harness/harness_eval.py) also reports per domain and
its error counts (`summarize`'s domain_of, errors), prints its table, intervals and families
with `format_eval`, and its last line with `eval_json`.

The unit is the task: a task's samples are averaged first, then tasks are resampled whole, so a
task with many samples does not count more than one with few.
"""
from __future__ import annotations

import json
from typing import Sequence

import numpy as np


def bootstrap_ci(per_task: np.ndarray, resamples: int, seed: int = 0, level: float = 0.95):
  """Percentile bootstrap interval of the mean over tasks (rows = tasks, resampled whole)."""
  x = np.asarray(per_task, np.float64)
  if x.size == 0:
    return [0.0, 0.0]
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(x), size=(resamples, len(x)))
  means = x[idx].mean(axis=1)
  a = (1.0 - level) / 2.0
  return [float(np.quantile(means, a)), float(np.quantile(means, 1.0 - a))]


def paired_bootstrap_delta(before: dict, after: dict, resamples: int, seed: int = 0,
                           level: float = 0.95):
  """Percentile bootstrap interval of mean(after - before) over the tasks both hold (task id ->
  pass rate). Both evals see the same tasks, and a task's outcome before predicts its outcome
  after (most tasks fail both or pass both), so resampling tasks as pairs gives the change a
  much narrower interval than the two separate intervals do."""
  ids = sorted(set(before) & set(after))
  return bootstrap_ci(np.array([after[i] - before[i] for i in ids]), resamples, seed, level)


def summarize(results: Sequence, tasks: Sequence, resamples: int, seed: int = 0, *,
              domain_of=None, errors: dict | None = None,
              outcome_order: Sequence[str] | None = None) -> dict:
  """pass@1 and mean reward over tasks (samples of a task averaged first), with 95% CIs.

  `results` are episode results (task_id, passed, reward, outcome); `tasks` carry id and family.
  Keys: n_tasks, n_episodes, pass_at_1, pass_at_1_ci95, mean_reward, mean_reward_ci95,
  outcomes (outcome -> episodes), by_family (family -> n_tasks, pass_at_1), per_task_pass.
  `--mode=eval`'s paths add: with `domain_of` (result -> its domain), n (episodes) and
  by_domain (`by_domain`); with `errors` (error kind -> count), errors; with `outcome_order`,
  the outcomes in that order, those that never happened left out.
  """
  by_task: dict[str, list] = {t.id: [] for t in tasks}
  for r in results:
    by_task.setdefault(r.task_id, []).append(r)
  rows = {tid: v for tid, v in by_task.items() if v}
  # Pass rate per task: the eval's unit, kept for the paired interval of a before/after change
  # (paired_bootstrap_delta) and broken down by family below.
  per_task_pass = {tid: float(np.mean([r.passed for r in v])) for tid, v in rows.items()}
  passed = np.array(list(per_task_pass.values()))
  reward = np.array([np.mean([r.reward for r in v]) for v in rows.values()])
  outcomes: dict[str, int] = {}
  for r in results:
    outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
  # pass@1 per task family: where the policy fails (a lookup it cannot do, a call it garbles).
  family = {t.id: getattr(t, "family", "") for t in tasks}
  fam_rows: dict[str, list] = {}
  for tid, p in per_task_pass.items():
    if family.get(tid):
      fam_rows.setdefault(family[tid], []).append(p)
  by_family = {f: {"n_tasks": len(v), "pass_at_1": float(np.mean(v))}
               for f, v in sorted(fam_rows.items())}
  if outcome_order is not None:
    outcomes = {o: outcomes[o] for o in outcome_order if outcomes.get(o)}
  s = {"n_tasks": len(rows), "n_episodes": len(results),
       "pass_at_1": float(passed.mean()) if len(rows) else 0.0,
       "pass_at_1_ci95": bootstrap_ci(passed, resamples, seed),
       "mean_reward": float(reward.mean()) if len(rows) else 0.0,
       "mean_reward_ci95": bootstrap_ci(reward, resamples, seed + 1),
       "outcomes": outcomes, "by_family": by_family, "per_task_pass": per_task_pass}
  if domain_of is not None:
    s["n"] = len(results)
    s["by_domain"] = by_domain(results, domain_of)
  if errors is not None:
    s["errors"] = dict(errors)
  return s


def format_summary(name: str, s: dict) -> str:
  """One line: pass@1 and mean reward with their intervals, and the number of tasks."""
  return format_intervals(name, s, "held-out tasks")


def format_intervals(name: str, s: dict, tasks: str = "tasks") -> str:
  """`format_summary`'s line with its tasks called `tasks` (e.g. the split's)."""
  lo, hi = s["pass_at_1_ci95"]
  rlo, rhi = s["mean_reward_ci95"]
  return (f"{name}: pass@1 {s['pass_at_1']:.3f} [95% CI {lo:.3f}, {hi:.3f}]  mean reward "
          f"{s['mean_reward']:.3f} [{rlo:.3f}, {rhi:.3f}]  ({s['n_tasks']} {tasks})")


def format_families(before: dict, after: dict) -> str:
  """One line: pass@1 per task family before -> after (tasks in parentheses)."""
  fams = sorted(set(before.get("by_family", {})) | set(after.get("by_family", {})))
  parts = []
  for f in fams:
    b, a = before.get("by_family", {}).get(f), after.get("by_family", {}).get(f)
    n = (a or b)["n_tasks"]
    parts.append(f"{f} {b['pass_at_1'] if b else float('nan'):.2f} -> "
                 f"{a['pass_at_1'] if a else float('nan'):.2f} ({n})")
  return "pass@1 by task family: " + ", ".join(parts)


def scalars(s: dict) -> dict:
  """The summary's figures that go to metrics.jsonl / TensorBoard."""
  return {"pass_at_1": s["pass_at_1"], "pass_at_1_lo": s["pass_at_1_ci95"][0],
          "pass_at_1_hi": s["pass_at_1_ci95"][1], "mean_reward": s["mean_reward"]}


def by_domain(results: Sequence, domain_of) -> dict:
  """n (episodes), pass_at_1 and mean_reward over the results of each domain (`domain_of(r)`),
  domains sorted: the table `--mode=eval` prints and returns under by_domain."""
  groups: dict[str, list] = {}
  for r in results:
    groups.setdefault(domain_of(r), []).append(r)
  return {d: _episode_means(v) for d, v in sorted(groups.items())}


def _episode_means(results: Sequence) -> dict:
  n = len(results)
  return {"n": n, "pass_at_1": sum(r.passed for r in results) / max(n, 1),
          "mean_reward": sum(r.reward for r in results) / max(n, 1)}


def format_by_family(s: dict) -> str:
  """One line: pass@1 per task family of one eval (tasks in parentheses)."""
  return "pass@1 by task family: " + (", ".join(
      f"{f} {v['pass_at_1']:.2f} ({v['n_tasks']})" for f, v in s["by_family"].items()) or "none")


def format_eval(name: str, s: dict, elapsed_s: float) -> list:
  """The lines an eval (`summarize`'s `s`, with domain_of) prints over its tasks: one per domain, all
  of them with the episode rate over `elapsed_s`, the intervals, pass@1 per family."""
  lines = [f"{d:24s} n={v['n']:4d}  pass@1={v['pass_at_1']:.4f}  mean_reward={v['mean_reward']:.4f}"
           for d, v in s["by_domain"].items()]
  lines.append(f"{'all':24s} n={s['n']:4d}  pass@1={s['pass_at_1']:.4f}  "
               f"mean_reward={s['mean_reward']:.4f}  ({elapsed_s:.1f}s, "
               f"{s['n'] / max(elapsed_s, 1e-9):.2f} episodes/s)")
  lines.append(format_intervals(name, s))
  lines.append(format_by_family(s))
  return lines


def eval_json(s: dict) -> str:
  """An eval's last line: one JSON object with pass_at_1, mean_reward, by_domain, errors."""
  return json.dumps({"pass_at_1": s["pass_at_1"], "mean_reward": s["mean_reward"],
                     "by_domain": s["by_domain"], "errors": s["errors"]})
