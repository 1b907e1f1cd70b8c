"""The one evaluation summary: intervals over tasks, samples averaged within a task, families."""
import dataclasses

import numpy as np
import pytest

from envs import eval_summary


def test_bootstrap_ci_brackets_the_mean_and_narrows_with_n():
  rng = np.random.default_rng(0)
  small = (rng.random(40) < 0.3).astype(float)
  big = (rng.random(4000) < 0.3).astype(float)
  lo, hi = eval_summary.bootstrap_ci(small, 2000)
  assert lo <= small.mean() <= hi
  blo, bhi = eval_summary.bootstrap_ci(big, 2000)
  assert bhi - blo < hi - lo
  assert eval_summary.bootstrap_ci(np.zeros(10), 100) == [0.0, 0.0]


@dataclasses.dataclass
class _R:
  task_id: str
  passed: bool
  reward: float
  outcome: str = "ok"


@dataclasses.dataclass
class _T:
  id: str
  family: str = "xlsx_lookup"


def test_summarize_eval_averages_samples_within_a_task_first():
  tasks = [_T("a"), _T("b")]
  res = [_R("a", True, 1.0), _R("a", False, 0.0), _R("b", True, 1.0), _R("b", True, 1.0)]
  s = eval_summary.summarize(res, tasks, 200)
  assert s["n_tasks"] == 2 and s["n_episodes"] == 4
  assert s["pass_at_1"] == pytest.approx(0.75)
  assert s["mean_reward"] == pytest.approx(0.75)
  assert s["pass_at_1_ci95"][0] <= 0.75 <= s["pass_at_1_ci95"][1]
  assert s["outcomes"] == {"ok": 4}
  assert s["by_family"] == {"xlsx_lookup": {"n_tasks": 2, "pass_at_1": 0.75}}
  assert s["per_task_pass"] == {"a": 0.5, "b": 1.0}


def test_summarize_eval_breaks_pass_at_1_down_by_family():
  tasks = [_T("a", "pdf_lookup"), _T("b", "pdf_lookup"), _T("c", "mail_lookup")]
  res = [_R("a", True, 1.0), _R("b", False, 0.0), _R("c", False, 0.0)]
  s = eval_summary.summarize(res, tasks, 100)
  assert s["by_family"] == {"mail_lookup": {"n_tasks": 1, "pass_at_1": 0.0},
                            "pdf_lookup": {"n_tasks": 2, "pass_at_1": 0.5}}
