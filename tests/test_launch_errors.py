"""Config errors in one line: launch.py ends an unknown key, a value of the wrong type or out of
range, and a file the mode reads that is not there with one line on stderr naming the key, exit
code 2, no traceback unless --verbose (configs/validate.py)."""
import os
import subprocess
import sys

import pytest

from configs import qwen3_5_35b_a3b
from configs import qwen3_5_397b_a17b
from configs import tiny_cpu
from configs import tiny_gpu
from configs import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(tmp_path, *args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), "--mode=rl",
                         "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"),
                         f"--config.workdir={tmp_path}", *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, line", [
    (["--config.train.stepz=3"],
     "launch.py: --config.train.stepz: unknown config key (did you mean train.steps?)"),
    (["--config.train.steps=abc"], "launch.py: --config.train.steps=abc: not an integer: 'abc'"),
    (["--config.train.steps=-1"], "launch.py: train.steps=-1: must be >= 0"),
    (["--config.train.micro_batches=3"],
     "launch.py: train.micro_batches=3: train.prompts_per_step x train.samples_per_prompt = 32 "
     "rows do not split into train.mini_batches x train.micro_batches = 1 x 3"),
    (["--config.train.init_from=/nowhere/base"],
     "launch.py: train.init_from='/nowhere/base': no such directory (a Hugging Face checkpoint "
     "directory; \"\" = random init)"),
    (["--config.envs.tasks_file=/nowhere/tasks.jsonl"],
     "launch.py: envs.tasks_file='/nowhere/tasks.jsonl': no such file or directory (a JSONL task "
     "file or an APEX-Agents task folder; \"\" = generated tasks)"),
    (["--config.rollout.sampler_choice=gpu"],
     "launch.py: rollout.sampler_choice='gpu': must be one of host | device (rl/rollout/README.md, "
     "sampling)"),
    (["--config=configs/nowhere.py"],
     "launch.py: --config=configs/nowhere.py: cannot load the config file ([Errno 2] No such "
     "file or directory: 'configs/nowhere.py')"),
], ids=["unknown_key", "wrong_type", "out_of_range", "rows_do_not_split", "missing_init_from",
        "missing_tasks_file", "unknown_sampler_choice", "missing_config_file"])
def test_a_config_error_is_one_line_on_stderr_naming_the_key_exit_code_2(tmp_path, args, line):
  out = _launch(tmp_path, *args)
  assert out.returncode == 2, out.stderr[-3000:]
  assert [l for l in out.stderr.splitlines() if l.strip()] == [line]
  assert not os.listdir(tmp_path)   # nothing written


def test_verbose_adds_the_traceback_before_the_line(tmp_path):
  out = _launch(tmp_path, "--config.train.stepz=3", "--verbose")
  assert out.returncode == 2
  lines = out.stderr.splitlines()
  assert lines[0] == "Traceback (most recent call last):"
  assert lines[-1] == ("launch.py: --config.train.stepz: unknown config key (did you mean "
                       "train.steps?)")


@pytest.mark.parametrize("key", validate.NON_NEGATIVE + validate.POSITIVE)
def test_every_count_out_of_range_is_refused_naming_its_key(key):
  c = tiny_cpu.get_config()
  *parents, last = key.split(".")
  node = c
  for p in parents:
    node = node[p]
  low = -1 if key in validate.NON_NEGATIVE else 0
  node[last] = type(node[last])(low)
  with pytest.raises(validate.ConfigError, match=rf"^{key}={low}(\.0)?: must be >= "):
    validate.check_values(c, "rl")


@pytest.mark.parametrize("get_config", [tiny_cpu.get_config, tiny_gpu.get_config,
                                        qwen3_5_35b_a3b.get_config, qwen3_5_397b_a17b.get_config])
def test_the_shipped_configs_pass(get_config):
  for mode in ("rl", "sft", "plan", "serve"):
    validate.check_values(get_config(), mode)
  validate.check_files(tiny_cpu.get_config(), "rl")   # the shipped base checkpoint is there


def test_unknown_keys_are_named_whole_with_the_suggestion_at_their_depth():
  argv = ["launch.py", "--config.trainz.steps=3"]
  err = KeyError("'trainz'\nDid you mean \"train\" instead of \"trainz\"?")
  assert validate.parse_error_line(err, argv) == (
      "--config.trainz.steps: unknown config key (did you mean train.steps?)")
  err = AttributeError(KeyError("'zzz'"))
  assert validate.parse_error_line(err, ["launch.py", "--config.train.zzz", "3"]) == (
      "--config.train.zzz: unknown config key")
