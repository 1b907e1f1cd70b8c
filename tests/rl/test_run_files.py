"""rl/run_files.py: where a run's files go, and a JSON file written whole."""
import json
import os

from configs import tiny_cpu
from rl import run_files


def test_the_run_and_sft_directories_follow_workdir_name_and_sft_dir(tmp_path):
  c = tiny_cpu.get_config()
  c.workdir = str(tmp_path)
  assert run_files.run_dir(c) == os.path.join(str(tmp_path), c.name)
  assert run_files.sft_dir(c) == os.path.join(str(tmp_path), c.name, "sft")
  c.sft.dir = "/elsewhere/sft"
  assert run_files.sft_dir(c) == "/elsewhere/sft"


def test_write_json_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
  path = str(tmp_path / "summary.json")
  run_files.write_json(path, {"a": 1})
  run_files.write_json(path, {"b": [1, 2]})
  with open(path, encoding="utf-8") as f:
    assert json.load(f) == {"b": [1, 2]}
  assert os.listdir(tmp_path) == ["summary.json"]
