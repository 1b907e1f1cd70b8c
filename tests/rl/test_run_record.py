"""rl/run_record.py: a run directory holds one run. The check launch.py runs before a mode
writes anything, called directly (tests/test_launch_run_dir.py runs it through launch.py, on
one process and on a pod)."""
import json
import os
import sys

import pytest

from configs import tiny_cpu
from configs.validate import ConfigError
from rl import distributed
from rl import evaluation
from rl import run_record

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_dir_utils  # noqa: E402


def _config(tmp_path, **overrides):
  """tiny_cpu under tmp_path with dotted-key overrides (`optim__lr=0.5` for optim.lr)."""
  c = tiny_cpu.get_config()
  c.workdir = str(tmp_path)
  for key, value in overrides.items():
    *parents, last = key.split("__")
    node = c
    for p in parents:
      node = node[p]
    node[last] = value
  return c


def _history(directory) -> list:
  with open(os.path.join(directory, run_record.HISTORY), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _started_run(tmp_path):
  """A run directory of tiny_cpu's config as --mode=rl leaves it after some steps."""
  c = _config(tmp_path)
  return c, run_dir_utils.started_run_dir(c)


def test_a_new_run_directory_records_the_resolved_config_and_the_code(tmp_path, capsys):
  c = _config(tmp_path)
  (v,) = run_record.guard(c, "rl")   # its SFT directory lies inside: one record
  rdir = os.path.join(tmp_path, "tiny_cpu")
  assert v.action == "start" and v.directory == rdir
  with open(os.path.join(rdir, run_record.RECORD), encoding="utf-8") as f:
    rec = json.load(f)
  assert rec["config"]["optim.lr"] == 0.2 and rec["config"]["train.steps"] == 12
  # Resolved: a derived value is recorded as what it follows to.
  assert rec["config"]["rollout.max_len"] == 2560
  assert rec["config_hash"] == run_record.config_hash(c)
  assert rec["code"]["sources"] == distributed.code_version()
  assert rec["code"]["git_commit"]   # this checkout is a git repository
  (line,) = _history(rdir)
  assert line["event"] == "start" and line["mode"] == "rl"
  assert f"run directory {rdir}: new" in capsys.readouterr().out


def test_the_same_config_resumes_without_changes(tmp_path, capsys):
  c, rdir = _started_run(tmp_path)
  (v,) = run_record.guard(_config(tmp_path), "rl")
  assert v.action == "resume" and v.changes == []
  assert [h["event"] for h in _history(rdir)] == ["start", "resume"]
  assert "same config as recorded" in capsys.readouterr().out


def test_an_unsafe_change_refuses_naming_each_key_and_changes_no_file(tmp_path):
  _, rdir = _started_run(tmp_path)
  before = run_dir_utils.file_digests(tmp_path)
  c = _config(tmp_path, optim__lr=0.5, rl__loss_reduction="token_mean", loop__progress=False)
  with pytest.raises(ConfigError) as e:
    run_record.guard(c, "rl")
  msg = str(e.value)
  assert f"{rdir} holds a run of another config; nothing was written" in msg
  assert "  optim.lr: 0.2 -> 0.5" in msg.splitlines()
  assert '  rl.loss_reduction: "prompt_mean" -> "token_mean"' in msg.splitlines()
  # The safe one is named as such; the ways on are named.
  assert "safe to change on resume: loop.progress: true -> false (console progress bars)" in msg
  assert "--config.name=tiny_cpu-2" in msg and "--config.resume=changed" in msg
  assert run_dir_utils.file_digests(tmp_path) == before


def test_keys_safe_on_resume_resume_and_are_logged(tmp_path, capsys):
  _, rdir = _started_run(tmp_path)
  c = _config(tmp_path, train__steps=14, loop__eval_every=2, checkpoint__keep=1)
  (v,) = run_record.guard(c, "rl")
  assert v.action == "resume"
  assert sorted(x.key for x in v.changes) == ["checkpoint.keep", "loop.eval_every",
                                              "train.steps"]
  last = _history(rdir)[-1]
  assert last["event"] == "resume"
  assert {"key": "train.steps", "was": 12, "now": 14, "accepted": "extends the run"} in \
      last["changes"]
  with open(os.path.join(rdir, run_record.RECORD), encoding="utf-8") as f:
    assert json.load(f)["config"]["train.steps"] == 14   # the run's config from now on
  out = capsys.readouterr().out
  assert "resuming with 3 changed keys" in out and "train.steps: 12 -> 14 (extends the run)" in out


def test_more_steps_refuse_where_the_schedule_follows_the_run_length_and_fewer_refuse(tmp_path):
  c = _config(tmp_path, optim__schedule="cosine")
  run_record.guard(c, "rl")
  with pytest.raises(ConfigError, match=r"train.steps: 12 -> 14 \(the cosine schedule's length"):
    run_record.guard(_config(tmp_path, optim__schedule="cosine", train__steps=14), "rl")
  # With the decay length set, the schedule no longer follows train.steps (optim.decay_steps
  # itself is a change, accepted here with the override).
  run_record.guard(_config(tmp_path, optim__schedule="cosine", optim__decay_steps=12,
                           resume="changed"), "rl")
  run_record.guard(_config(tmp_path, optim__schedule="cosine", optim__decay_steps=12,
                           train__steps=14), "rl")
  with pytest.raises(ConfigError, match=r"train.steps: 14 -> 10 \(shortens the run\)"):
    run_record.guard(_config(tmp_path, optim__schedule="cosine", optim__decay_steps=12,
                             train__steps=10), "rl")


def test_resume_changed_continues_with_the_change_recorded(tmp_path, capsys):
  _, rdir = _started_run(tmp_path)
  c = _config(tmp_path, optim__lr=0.5, resume="changed")
  (v,) = run_record.guard(c, "rl")
  assert v.action == "resume"
  last = _history(rdir)[-1]
  assert last["changes"] == [
      {"key": "optim.lr", "was": 0.2, "now": 0.5, "accepted": "--config.resume=changed"},
      {"key": "resume", "was": "same", "now": "changed",
       "accepted": "says how a change is handled"}]
  assert "optim.lr: 0.2 -> 0.5 (--config.resume=changed)" in capsys.readouterr().out
  # The recorded config is the new one: the same command again resumes as is.
  (v,) = run_record.guard(_config(tmp_path, optim__lr=0.5), "rl")
  assert [x.key for x in v.changes] == ["resume"]


def test_a_directory_without_a_record_is_adopted(tmp_path, capsys):
  rdir = tmp_path / "tiny_cpu"
  rdir.mkdir()
  (rdir / "metrics.jsonl").write_text("{}\n")
  (v,) = run_record.guard(_config(tmp_path), "rl")
  assert v.action == "adopt"
  assert _history(str(rdir))[0]["event"] == "adopt"
  assert "its earlier config is unknown" in capsys.readouterr().out


def test_an_unreadable_record_refuses(tmp_path):
  rdir = tmp_path / "tiny_cpu"
  rdir.mkdir()
  (rdir / run_record.RECORD).write_text("{not json")
  with pytest.raises(ConfigError, match="run_config.json is unreadable"):
    run_record.guard(_config(tmp_path), "rl")


def test_an_sft_directory_compares_the_keys_sft_reads_when_sft_trains_into_it(tmp_path):
  shared = str(tmp_path / "shared_sft")
  run_record.guard(_config(tmp_path, name="a", sft__dir=shared), "sft")
  assert os.path.isfile(os.path.join(shared, run_record.RECORD))
  # Another run name and an RL key: its own run directory is new, the SFT keys are the same.
  verdicts = run_record.guard(_config(tmp_path, name="b", sft__dir=shared,
                                      rl__loss_reduction="token_mean"), "sft")
  assert [(v.kind, v.action) for v in verdicts] == [("run", "start"), ("sft", "resume")]
  before = run_dir_utils.file_digests(tmp_path)
  with pytest.raises(ConfigError) as e:
    run_record.guard(_config(tmp_path, name="c", sft__dir=shared, sft__lr=1e-3), "sft")
  assert f"{shared} holds SFT params of another config" in str(e.value)
  assert "  sft.lr: 0.0003 -> 0.001" in str(e.value).splitlines()
  assert "another --config.sft.dir" in str(e.value)
  assert run_dir_utils.file_digests(tmp_path) == before   # run directory c not made either


def test_a_run_that_only_reads_sft_params_leaves_their_directory_unchecked(tmp_path):
  shared = tmp_path / "shared_sft"
  run_record.guard(_config(tmp_path, name="a", sft__dir=str(shared)), "sft")
  (shared / "4").mkdir()   # SFT saved its params
  c = _config(tmp_path, name="b", sft__dir=str(shared), harness__style="shell")
  assert run_record.directories(c, "rl") == [(os.path.join(tmp_path, "b"), "run")]
  # Where SFT will train into it (no params yet), the same run checks it.
  (shared / "4").rmdir()
  assert run_record.directories(c, "rl")[1] == (str(shared), "sft")
  with pytest.raises(ConfigError, match='harness.style: "mcp" -> "shell"'):
    run_record.guard(c, "rl")


def test_the_summary_records_the_config_hash_which_leaves_out_where_files_go(tmp_path):
  c = _config(tmp_path)
  out = evaluation.finish_summary({}, c, [])
  assert out["config_hash"] == run_record.config_hash(c)
  assert run_record.config_hash(_config(tmp_path / "x", name="other")) == out["config_hash"]
  assert run_record.config_hash(_config(tmp_path, optim__lr=0.5)) != out["config_hash"]
