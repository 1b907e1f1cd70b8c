"""benchmarks/rl_replication.py: per-seed and pooled rows from the runs' per-task outcomes, a
finished run read instead of rerun, and the protocol's seeds."""
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import rl_replication  # noqa: E402  (benchmarks/ is not a package)
from configs import seeds  # noqa: E402


def _summary(before, after):
  def ev(rates):   # every task in one family, "f"
    return {"per_task_pass": rates,
            "by_family": {"f": {"n_tasks": len(rates), "pass_at_1": sum(rates.values()) / len(rates)}}}
  return {"before_rl": ev(before), "after_rl": ev(after)}


def test_a_row_holds_the_means_and_the_paired_change_of_the_tasks_both_evals_saw():
  before = {f"t{i}": float(i % 4 == 0) for i in range(40)}
  after = dict(before, t1=1.0, t2=1.0, t3=1.0)
  r = rl_replication.row("s", before, after)
  assert r["tasks"] == 40
  assert r["before"] == pytest.approx(0.25) and r["after"] == pytest.approx(0.325)
  assert r["delta"] == pytest.approx(0.075)
  lo, hi = r["delta_ci95"]
  assert 0 <= lo < 0.075 < hi   # three tasks gained, none lost: the change is never negative


def test_the_seeds_finished_runs_are_read_and_pooled_over_distinct_tasks(tmp_path, capsys,
                                                                          monkeypatch):
  outcomes = {101: ({"a": 0.0, "b": 1.0}, {"a": 1.0, "b": 1.0}),
              102: ({"a": 0.0, "b": 0.0}, {"a": 0.0, "b": 0.0})}
  for seed, (before, after) in outcomes.items():
    cmd = rl_replication.seed_command(seed, "arm", ["--config.optim.lr=0.1"], str(tmp_path))
    rdir = tmp_path / f"replication-arm-s{seed}"
    rdir.mkdir()
    (rdir / "command.json").write_text(json.dumps(cmd[1:]))
    (rdir / "summary.json").write_text(json.dumps(_summary(before, after)))
  monkeypatch.setattr(sys, "argv", ["rl_replication.py", "--seeds=101,102", "--name=arm",
                                    f"--workdir={tmp_path}", "--config.optim.lr=0.1"])
  rl_replication.main()   # runs nothing: both seeds' runs of this command are finished
  rows = json.loads((tmp_path / "replication" / "arm.json").read_text())["rows"]
  assert [r["seed"] for r in rows] == ["101", "102", "pooled"]
  assert rows[-1]["tasks"] == 4                     # "101/a" and "102/a" are different tasks
  assert rows[-1]["delta"] == pytest.approx(0.25)
  assert "every seed's change positive: False" in capsys.readouterr().out


def test_overrides_that_the_script_sets_per_seed_are_refused(monkeypatch):
  monkeypatch.setattr(sys, "argv", ["rl_replication.py", "--config.envs.seed=3"])
  with pytest.raises(SystemExit, match="set per seed"):
    rl_replication.main()


def test_dev_and_reporting_seeds_are_disjoint_and_the_default_worlds_are_dev():
  assert not set(seeds.DEV_SEEDS) & set(seeds.REPORTING_SEEDS)
  assert 0 in seeds.DEV_SEEDS and len(seeds.REPORTING_SEEDS) >= 3
  assert rl_replication.parse_seeds("reporting") == seeds.REPORTING_SEEDS
  assert np.all(np.array(rl_replication.parse_seeds("5,6")) == [5, 6])


def _finished_arm(tmp_path, name, overrides, outcomes):
  for seed, (before, after) in outcomes.items():
    cmd = rl_replication.seed_command(seed, name, overrides, str(tmp_path))
    rdir = tmp_path / f"replication-{name}-s{seed}"
    rdir.mkdir()
    (rdir / "command.json").write_text(json.dumps(cmd[1:]))
    (rdir / "summary.json").write_text(json.dumps(_summary(before, after)))


def test_an_arm_against_another_pairs_their_after_rl_outcomes_per_task(tmp_path, monkeypatch):
  start = {"a": 0.0, "b": 0.0, "c": 1.0}
  _finished_arm(tmp_path, "base", [], {101: (start, {"a": 1.0, "b": 0.0, "c": 1.0}),
                                       102: (start, {"a": 0.0, "b": 0.0, "c": 1.0})})
  _finished_arm(tmp_path, "new", ["--config.optim.lr=0.1"],
                {101: (start, {"a": 1.0, "b": 1.0, "c": 1.0}),
                 102: (start, {"a": 0.0, "b": 0.0, "c": 0.0})})
  monkeypatch.setattr(sys, "argv", ["rl_replication.py", "--seeds=101,102", "--name=new",
                                    f"--workdir={tmp_path}", "--against=base",
                                    "--config.optim.lr=0.1"])
  rl_replication.main()
  vs = json.loads((tmp_path / "replication" / "new.json").read_text())["against"]
  assert vs["arm"] == "base" and [r["seed"] for r in vs["rows"]] == ["101", "102", "pooled"]
  assert vs["rows"][0]["delta"] == pytest.approx(1 / 3)     # task b: 0 -> 1
  assert vs["rows"][1]["delta"] == pytest.approx(-1 / 3)    # task c: 1 -> 0
  assert vs["rows"][2]["delta"] == pytest.approx(0.0) and vs["rows"][2]["tasks"] == 6
  fam = vs["by_family"]["f"]       # pooled over both seeds' 3 tasks each
  assert fam["tasks"] == 6 and fam["start"] == pytest.approx(2 / 6)
  assert fam["base"] == pytest.approx(3 / 6) and fam["new"] == pytest.approx(3 / 6)


def test_against_an_arm_without_finished_runs_names_the_missing_run(tmp_path, monkeypatch):
  _finished_arm(tmp_path, "new", [], {101: ({"a": 0.0}, {"a": 1.0})})
  monkeypatch.setattr(sys, "argv", ["rl_replication.py", "--seeds=101", "--name=new",
                                    f"--workdir={tmp_path}", "--against=missing"])
  with pytest.raises(SystemExit, match="arm 'missing' has no finished run on seed 101"):
    rl_replication.main()
