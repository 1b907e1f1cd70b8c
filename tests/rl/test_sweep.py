"""Sweeps: jobs from sweep files, commands, and the comparison table."""
import json
import os
import subprocess
import sys

import pytest

from configs import qwen3_5_35b_a3b
from configs import seeds
from configs import tiny_cpu
from rl import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sweep_jobs_cover_both_arms_and_reject_unknown_keys(tmp_path):
  c = tiny_cpu.get_config()
  jobs = sweep.load_sweep(os.path.join(ROOT, "configs/sweeps/loss_reduction.py"))
  assert {j["rl.loss_reduction"] for j in jobs} == {"token_mean", "prompt_mean"}
  assert {j["harness.nudge"] for j in jobs} == {True, False}
  cmds = sweep.job_commands(c, jobs, ["launch.py", "--mode=rl", "--sweep=x", "--dry_run"])
  assert len({name for name, _, _ in cmds}) == 4
  for _, job, args in cmds:
    assert not any(a.startswith(("--sweep", "--dry_run")) for a in args)
    assert f"--config.rl.loss_reduction={job['rl.loss_reduction']}" in args
    assert any(a.startswith("--config.sft.dir=") for a in args)
  with pytest.raises(SystemExit, match="rl.los_reduction"):
    sweep.job_commands(c, [{"rl.los_reduction": "token_mean"}], ["launch.py"])


@pytest.mark.parametrize("name", sorted(
    f for f in os.listdir(os.path.join(ROOT, "configs", "sweeps")) if not f.startswith("_")))
def test_every_sweep_file_makes_one_command_per_job_of_known_keys(name):
  c = tiny_cpu.get_config()
  jobs = sweep.load_sweep(os.path.join(ROOT, "configs", "sweeps", name))
  cmds = sweep.job_commands(c, jobs, ["launch.py", "--mode=rl"])   # exits on an unknown key
  assert len({n for n, _, _ in cmds}) == len(jobs) >= 2


def _token_vs_prompt_mean_sweep(tmp_path):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.workdir = str(tmp_path)
  jobs = [{"name": "tm", "rl.loss_reduction": "token_mean"},
          {"name": "pm", "rl.loss_reduction": "prompt_mean"}]
  return c, sweep.job_commands(c, jobs, ["launch.py"])


def test_sweep_table_reads_summaries(tmp_path):
  c, cmds = _token_vs_prompt_mean_sweep(tmp_path)
  run = tmp_path / "tiny_cpu-tm"
  run.mkdir()
  s = {"pass_at_1": 0.2, "pass_at_1_ci95": [0.1, 0.3], "mean_reward": 0.2}
  (run / "summary.json").write_text(json.dumps({"before_rl": s, "after_rl": dict(s, pass_at_1=0.4)}))
  t = sweep.table(c, cmds)
  assert "| tiny_cpu-tm | token_mean | 0.200 | 0.400 [0.100, 0.300] | +0.200 |" in t
  assert "tiny_cpu-pm" in t and "(no summary)" in t
  run = tmp_path / "tiny_cpu-pm"
  run.mkdir()
  (run / "summary.json").write_text(json.dumps({"before_rl": s, "after_rl": s,
                                                "delta_pass_at_1_ci95": [-0.05, 0.05]}))
  assert "| tiny_cpu-pm | prompt_mean | 0.200 | 0.200 [0.100, 0.300] | +0.000 [-0.050, +0.050] |" \
      in sweep.table(c, cmds)


def test_sweep_table_compares_each_arm_with_the_first_on_paired_tasks(tmp_path):
  c, cmds = _token_vs_prompt_mean_sweep(tmp_path)
  ids = [f"t{i}" for i in range(100)]
  for name, passing in (("tm", 20), ("pm", 30)):   # pm passes tm's 20 tasks and 10 more
    per_task = {t: float(i < passing) for i, t in enumerate(ids)}
    s = {"pass_at_1": passing / 100, "pass_at_1_ci95": [0.0, 1.0], "mean_reward": 0.0,
         "per_task_pass": per_task}
    (tmp_path / f"tiny_cpu-{name}").mkdir()
    (tmp_path / f"tiny_cpu-{name}" / "summary.json").write_text(
        json.dumps({"before_rl": s, "after_rl": s}))
  t = sweep.table(c, cmds)
  assert "after vs tiny_cpu-tm (paired 95% CI)" in t
  row = [r for r in t.splitlines() if r.startswith("| tiny_cpu-pm ")][0]
  cell = row.strip("| ").split(" | ")[-1]
  assert cell.startswith("+0.100 [")
  lo, hi = (float(x) for x in cell[len("+0.100 ["):-1].split(", "))
  assert 0.0 < lo < 0.1 < hi


def test_launch_sweep_dry_run_prints_the_jobs():
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), "--mode=rl",
                        "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"),
                        "--sweep=" + os.path.join(ROOT, "configs/sweeps/loss_reduction.py"),
                        "--dry_run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.count("--config.rl.loss_reduction=") == 4


def test_a_tuple_of_strings_reaches_the_job_as_that_tuple():
  c = tiny_cpu.get_config()
  cmds = sweep.job_commands(c, sweep.load_sweep(os.path.join(ROOT, "configs/sweeps/harness_transfer.py")),
                            ["launch.py", "--mode=rl"])
  for _, job, args in cmds:
    assert "--config.loop.eval_styles=('mcp','shell')" in args
    assert f"--config.harness.style={job['harness.style']}" in args


def test_style_table_shows_each_arm_under_each_style(tmp_path):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.workdir = str(tmp_path)
  jobs = [{"name": "m", "harness.style": "mcp", "loop.eval_styles": ("mcp", "shell")},
          {"name": "s", "harness.style": "shell", "loop.eval_styles": ("mcp", "shell")}]
  cmds = sweep.job_commands(c, jobs, ["launch.py"])
  assert sweep.style_table(c, cmds) == ""   # no summaries yet
  s = lambda p: {"pass_at_1": p, "pass_at_1_ci95": [0.0, 1.0], "mean_reward": p}  # noqa: E731
  for name, other in (("m", "shell"), ("s", "mcp")):
    (tmp_path / f"tiny_cpu-{name}").mkdir()
    (tmp_path / f"tiny_cpu-{name}" / "summary.json").write_text(json.dumps(
        {"before_rl": s(0.1), "after_rl": s(0.3),
         "by_style": {other: {"before_rl": s(0.0), "after_rl": s(0.05)}}}))
  t = sweep.style_table(c, cmds)
  assert "| tiny_cpu-m | mcp | mcp | 0.100 | 0.300 | +0.200 |" in t
  assert "| tiny_cpu-m | mcp | shell | 0.000 | 0.050 | +0.050 |" in t
  assert "| tiny_cpu-s | shell | mcp | 0.000 | 0.050 | +0.050 |" in t


def test_a_sweep_on_a_reporting_world_seed_stops_before_any_job_runs():
  c = tiny_cpu.get_config()
  with pytest.raises(SystemExit, match="reporting seed"):
    sweep.job_commands(c, [{"optim.lr": 0.1}, {"envs.seed": seeds.REPORTING_SEEDS[0]}],
                       ["launch.py"])
  with c.unlocked():
    c.envs.seed = seeds.REPORTING_SEEDS[-1]
  with pytest.raises(SystemExit, match="benchmarks/rl_replication.py"):
    sweep.job_commands(c, [{"optim.lr": 0.1}], ["launch.py"])
  with c.unlocked():
    c.envs.seed = seeds.DEV_SEEDS[-1]
  assert len(sweep.job_commands(c, [{"optim.lr": 0.1}], ["launch.py"])) == 1
  assert not set(seeds.DEV_SEEDS) & set(seeds.REPORTING_SEEDS)


def _sweep_file(tmp_path, jobs: list) -> str:
  path = tmp_path / "sweep_file.py"
  path.write_text(f"def get_sweep(arg=None):\n  return {jobs!r}\n")
  return str(path)


def test_a_dry_run_shows_what_each_job_resolves_to_derived_values_included(tmp_path, capsys):
  c = qwen3_5_35b_a3b.get_config()
  spec = _sweep_file(tmp_path, [{"name": "short", "train.max_context": 4096},
                                {"name": "shallow", "model.num_hidden_layers": 4}])
  sweep.run_sweep(spec, c, "plan", ["launch.py", "--mode=plan"], dry_run=True)
  out = capsys.readouterr().out
  assert out.startswith("model: 40 layers")            # the sweep's own config first
  assert ("resolves to: rollout.max_len=4096 (was 160000), train.max_context=4096 "
          "(was 160000)") in out
  assert "resolves to: model.num_hidden_layers=4 (was 40)" in out


def test_two_jobs_that_resolve_to_the_same_config_stop_the_sweep_naming_them(tmp_path):
  c = qwen3_5_35b_a3b.get_config()
  # 40 layers is what the preset gives already: the job changes nothing.
  spec = _sweep_file(tmp_path, [{"name": "default"},
                                {"name": "deep", "model.num_hidden_layers": 40},
                                {"name": "shallow", "model.num_hidden_layers": 4}])
  with pytest.raises(SystemExit, match="jobs qwen3_5_35b_a3b-default and qwen3_5_35b_a3b-deep "
                                       "resolve to the same config"):
    sweep.run_sweep(spec, c, "plan", ["launch.py", "--mode=plan"], dry_run=True)
