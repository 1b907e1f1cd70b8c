"""The RL run's summary.json: the improvement rule, the paired interval, the eval temperature."""
import types

import pytest

from configs import tiny_cpu
from envs import eval_summary
from rl import evaluation


def _R(task_id, passed, reward):   # an episode result, as the summary reads it
  return types.SimpleNamespace(task_id=task_id, passed=passed, reward=reward, outcome="ok")


def _T(task_id):   # a held-out task
  return types.SimpleNamespace(id=task_id, family="xlsx_lookup")


def test_summary_format_and_improvement_rule():
  c = tiny_cpu.get_config()
  ev = [_T("a"), _T("b")]
  b = {"pass_at_1": 0.2, "pass_at_1_ci95": [0.1, 0.3], "mean_reward": 0.2}
  out = evaluation.finish_summary({"before_rl": b, "after_rl": dict(b, pass_at_1=0.45, pass_at_1_ci95=[0.35, 0.55])}, c, ev)
  assert out["improved_outside_cis"] and out["delta_pass_at_1"] == pytest.approx(0.25)
  assert out["eval_subset"]["n_tasks"] == 2 and out["eval_subset"]["task_ids"] == ["a", "b"]
  out = evaluation.finish_summary({"before_rl": b, "after_rl": dict(b, pass_at_1=0.35, pass_at_1_ci95=[0.15, 0.5])}, c, ev)
  assert not out["improved_outside_cis"]  # 0.2 lies inside the after-RL interval


def test_paired_delta_interval_sees_a_gain_the_separate_intervals_cannot():
  # 168 tasks; 24 pass before, the same 24 and 6 more after: the separate 95% intervals
  # overlap (no "outside both"), but each task pairs with itself and the change is all gain.
  c = tiny_cpu.get_config()
  ev = [_T(f"t{i}") for i in range(168)]
  before = [_R(t.id, i < 24, float(i < 24)) for i, t in enumerate(ev)]
  after = [_R(t.id, i < 30, float(i < 30)) for i, t in enumerate(ev)]
  b = eval_summary.summarize(before, ev, 2000)
  a = eval_summary.summarize(after, ev, 2000)
  out = evaluation.finish_summary({"before_rl": b, "after_rl": a}, c, ev)
  lo, hi = out["delta_pass_at_1_ci95"]
  assert not out["improved_outside_cis"]
  assert out["delta_pass_at_1"] == pytest.approx(6 / 168)
  assert 0.0 < lo <= out["delta_pass_at_1"] <= hi
  assert hi - lo < 0.6 * (b["pass_at_1_ci95"][1] - b["pass_at_1_ci95"][0])
  # Outcomes that only trade places (as many lost as gained) give an interval around zero.
  swapped = [_R(t.id, 6 <= i < 30, float(6 <= i < 30)) for i, t in enumerate(ev)]
  lo, hi = evaluation.finish_summary({"before_rl": b, "after_rl": eval_summary.summarize(swapped, ev, 2000)},
                        c, ev)["delta_pass_at_1_ci95"]
  assert lo < 0.0 < hi


def test_eval_temperature_defaults_to_the_training_temperature_and_is_recorded():
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.loop.eval_temperature = -1.0
    c.rl.temperature = 0.7
  assert evaluation.eval_temperature(c) == pytest.approx(0.7)
  with c.unlocked():
    c.loop.eval_temperature = 0.0
  assert evaluation.eval_temperature(c) == 0.0
  assert evaluation.finish_summary({}, c, [_T("a")])["eval_subset"]["temperature"] == 0.0
