"""Held-out evaluation of the policy an RL run serves: before RL (after SFT), every
loop.eval_every steps, and after RL; and the run's summary.json around those figures.

Every eval of one run sees the same tasks (loop.eval_levels, loop.eval_max_tasks of the eval
split) at loop.eval_temperature, with episode seeds keyed by the step, so a before/after change is
measured task by task (the paired interval of envs.eval_summary).

`main_eval` is `--mode=eval` (envs/scripted_eval.py) with its tasks split over the job's
processes.
"""
from __future__ import annotations

from envs import eval_summary
from envs import scripted_eval
from rl import distributed
from rl import judge_server
from rl import run_record
from rl.run_files import starts_from_sft
from rl.rollout.draw import run_pool
from rl.task_data import make_episodes

# Added to every held-out episode seed at step s: 7919 * (s + 1); RL draws use 104729 * (s + 1).
EVAL_SEED_STRIDE = 7919


def eval_temperature(config) -> float:
  """loop.eval_temperature, or the RL sampling temperature when it is negative."""
  t = float(config.loop.eval_temperature)
  return float(config.rl.temperature) if t < 0 else t


def evaluate(pool, config, tasks, step: int, tag: str) -> dict:
  """loop.eval_samples episodes of each task with the served policy -> eval_summary.summarize."""
  eps = make_episodes(tasks, config, config.loop.eval_samples,
                      seed_offset=EVAL_SEED_STRIDE * (step + 1),
                      temperature=eval_temperature(config))
  results = run_pool(pool, eps, config, f"eval {tag}")
  return eval_summary.summarize(results, tasks, config.loop.bootstrap, config.seed)


def other_styles(config) -> list:
  """loop.eval_styles other than the one RL trains under (harness.style), in order."""
  return [s for s in dict.fromkeys(config.loop.eval_styles) if s != config.harness.style]


def evaluate_other_styles(pool, config, tasks, step: int, tag: str, summary: dict,
                          key: str) -> None:
  """The same held-out eval under each of `other_styles` (the same served policy, episodes
  whose worlds serve that style's tools), into summary["by_style"][style][key]."""
  for style in other_styles(config):
    c = config.copy_and_resolve_references()
    c.harness.style = style
    summary.setdefault("by_style", {}).setdefault(style, {})[key] = evaluate(
        pool, c, tasks, step, f"{tag}, {style} tools")


def _change(b: dict, a: dict, config) -> dict:
  out = {"delta_pass_at_1": a["pass_at_1"] - b["pass_at_1"]}
  if "per_task_pass" in b and "per_task_pass" in a:
    out["delta_pass_at_1_ci95"] = eval_summary.paired_bootstrap_delta(
        b["per_task_pass"], a["per_task_pass"], int(config.loop.bootstrap), int(config.seed))
  return out


def before_label(config) -> str:
  return "before RL (after SFT)" if starts_from_sft(config) else "before RL"


def finish_summary(summary: dict, config, eval_tasks) -> dict:
  """summary.json: the evals so far, what they were run on, and (with both) the change."""
  out = dict(summary)
  out["config"] = config.name
  # The resolved config it was made with (as in the run directory's run_config.json).
  out["config_hash"] = run_record.config_hash(config)
  out["eval_subset"] = {"split": "eval", "levels": list(config.loop.eval_levels),
                        "max_tasks": int(config.loop.eval_max_tasks), "n_tasks": len(eval_tasks),
                        "samples_per_task": int(config.loop.eval_samples),
                        "temperature": eval_temperature(config),
                        "task_ids": [t.id for t in eval_tasks]}
  out["rl_steps"] = int(config.train.steps)
  b, a = out.get("before_rl"), out.get("after_rl")
  if b and a:
    out["delta_pass_at_1"] = a["pass_at_1"] - b["pass_at_1"]
    # The margin is outside both intervals: the after-RL figure lies above the before-RL
    # interval, and the before-RL figure below the after-RL interval.
    out["improved_outside_cis"] = bool(a["pass_at_1"] > b["pass_at_1_ci95"][1]
                                       and b["pass_at_1"] < a["pass_at_1_ci95"][0])
    out.update(_change(b, a, config))
  for runs in out.get("by_style", {}).values():
    if "before_rl" in runs and "after_rl" in runs:
      runs.update(_change(runs["before_rl"], runs["after_rl"], config))
  return out


def print_before_after(out: dict, config, summary_path: str) -> None:
  """The run's closing lines: both evals, pass@1 by family, and the paired change."""
  print(eval_summary.format_summary(before_label(config), out["before_rl"]), flush=True)
  print(eval_summary.format_summary("after RL", out["after_rl"]), flush=True)
  print(eval_summary.format_families(out["before_rl"], out["after_rl"]), flush=True)
  for style, runs in out.get("by_style", {}).items():
    if "delta_pass_at_1" in runs:
      print(f"under the {style} tools: pass@1 {runs['before_rl']['pass_at_1']:.3f} -> "
            f"{runs['after_rl']['pass_at_1']:.3f}, change {runs['delta_pass_at_1']:+.3f}"
            f"{_paired(runs)}", flush=True)
  print(f"RL raised pass@1 by {out['delta_pass_at_1']:+.3f}{_paired(out)}; outside both "
        f"intervals: {out['improved_outside_cis']}; summary in {summary_path}", flush=True)


def _paired(out: dict) -> str:
  paired = out.get("delta_pass_at_1_ci95")
  return f" (paired 95% CI {paired[0]:+.3f}, {paired[1]:+.3f})" if paired else ""


def main_eval(config, flags=None) -> dict:
  """--mode=eval: a scripted policy or a checkpoint over the eval tasks. In a job of several
  processes each runs its block of the tasks on its own worlds (and engine) and every one pools
  the outcomes, so the summary is the single-process run's; process 0 prints it. With
  envs.judge.checkpoint set and no envs.judge.endpoint, the judge is served for the eval
  (rl/judge_server.py)."""
  split = distributed.work_split("eval", float(config.distributed.exchange_timeout_s))
  with judge_server.judged(config) as cfg:
    return scripted_eval.main(cfg, flags, split=split)
