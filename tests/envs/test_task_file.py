"""Tasks from JSONL files: the round trip of generated tasks, every validation error, the
dispatch of load_tasks, relative world folders."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from configs import base
from configs import tiny_cpu
from envs import tasks as tasks_lib
from envs.tasks import rubric
from envs.tasks import task_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APEX_FIXTURE = os.path.join(ROOT, "tests", "envs", "fixtures", "archipelago")


def _write_lines(path, records) -> str:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


def _record(**over) -> dict:
  rec = {"id": "t1", "split": "eval", "prompt": "What is 2 + 2?", "domain": "arithmetic",
         "world_dir": "world", "rubric": [{"type": "answer_number", "value": 4, "decimals": 0},
                                          {"type": "judge", "instruction": "Shows the sum."}]}
  rec.update(over)
  return {k: v for k, v in rec.items() if v is not None}


@pytest.fixture()
def world(tmp_path):
  d = tmp_path / "world" / "files"
  d.mkdir(parents=True)
  (d / "note.txt").write_text("2 + 2 = 4\n")
  return str(tmp_path / "world")


def _cfg(tasks_file="", fmt="auto", worlds_root=""):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.envs.tasks_file = tasks_file
    c.envs.tasks_format = fmt
    if worlds_root:
      c.envs.worlds_root = worlds_root
  return c.envs


@pytest.mark.parametrize("make", [tiny_cpu.get_config, base.get_config], ids=["tiny_cpu", "base"])
def test_generated_tasks_written_and_read_back_are_equal_tasks_for_both_splits(make, tmp_path):
  envs_cfg = make().envs
  for split in tasks_lib.SPLITS:
    tasks = tasks_lib.load_split(envs_cfg, split)
    path = str(tmp_path / f"{split}.jsonl")
    task_file.write_jsonl(tasks, path)
    back = task_file.read_jsonl(path)
    assert back == tasks
    with open(path) as f:
      assert sum(1 for _ in f) == len(tasks)
    # Through the config key, the file's split comes back in file order.
    assert tasks_lib.load_tasks(_cfg(path), split) == tasks


def test_export_script_writes_the_configs_tasks(tmp_path):
  out = str(tmp_path / "eval.jsonl")
  subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "export_tasks.py"),
                  "--config=" + os.path.join(ROOT, "configs", "tiny_cpu.py"), "--out=" + out,
                  "--split=eval"], check=True, cwd=ROOT, capture_output=True)
  assert task_file.read_jsonl(out) == tasks_lib.load_split(tiny_cpu.get_config().envs, "eval")


def test_a_hand_written_task_reads_with_defaults_and_its_world_folder_made_absolute(tmp_path,
                                                                                   world):
  path = _write_lines(tmp_path / "tasks.jsonl", [_record(weights=[3, 1], tags=["mine"])])
  (t,) = task_file.read_jsonl(path)
  assert t.world_dir == world and os.path.isabs(t.world_dir) and t.world_id == ""
  assert (t.level, t.family, t.oracle_steps, t.oracle_answer) == (0, "", (), "")
  assert t.weights == (3, 1) and t.tags == ("mine",) and t.rubric[1]["type"] == "judge"
  assert not task_file.has_oracle(t)


def test_text_with_line_separators_and_non_ascii_survives_the_round_trip(tmp_path, world):
  path = _write_lines(tmp_path / "tasks.jsonl", [_record()])
  (t,) = task_file.read_jsonl(path)
  odd = dataclasses.replace(t, prompt="Résumé\u2028of Q3\u2029\x1c— 42 €\nnext line",
                            input_files={"notes/ü.txt": "a\rb\u0085c"})
  task_file.write_jsonl([odd], path)
  assert task_file.read_jsonl(path) == [odd]


def test_relative_world_dir_resolves_against_the_files_folder_not_the_working_dir(tmp_path,
                                                                                  monkeypatch):
  sub = tmp_path / "project" / "tasks"
  (sub / "worlds" / "w1").mkdir(parents=True)
  path = _write_lines(sub / "tasks.jsonl", [_record(world_dir="worlds/w1"),
                                            _record(id="t2", world_dir="../tasks/worlds/w1")])
  monkeypatch.chdir(tmp_path)
  a, b = task_file.read_jsonl(path)
  assert a.world_dir == b.world_dir == str(sub / "worlds" / "w1")
  # Written again elsewhere, the folder stays the same (stored absolute).
  again = str(tmp_path / "elsewhere" / "copy.jsonl")
  task_file.write_jsonl([a, b], again)
  assert task_file.read_jsonl(again) == [a, b]


BAD_LINES = [
    # (record or raw line, field named, words of the problem)
    (_record(rubric=[{"type": "answer_colour", "colour": "red"}]), "rubric[0]",
     "unknown criterion type 'answer_colour'"),
    (_record(prompt=None), "prompt", "missing"),
    (_record(prompt="  "), "prompt", "non-empty"),
    (_record(split="test"), "split", "'test'"),
    (_record(world_dir="no_such_world"), "world_dir", "no such folder"),
    (_record(world_id="in00"), "world_id", "not both"),
    (_record(world_dir=None), "world_id", "exactly one"),
    (_record(promt="typo"), "promt", "unknown field"),
    (_record(rubric=[]), "rubric", "non-empty list"),
    (_record(rubric=None), "rubric", "missing"),
    (_record(rubric=[{"type": "answer_number"}]), "rubric[0]", "needs 'value'"),
    (_record(rubric=[{"type": "answer_number", "value": "4"}]), "rubric[0]", "wrong type"),
    (_record(rubric=[{"type": "answer_date", "date": "7 March 2025"}]), "rubric[0]", "ISO date"),
    (_record(rubric=[{"type": "file_contains", "path": "a.txt", "contains": [{"num": 4}]}]),
     "rubric[0]", "contains[0]"),
    (_record(rubric=[{"type": "judge", "instruction": ""}]), "rubric[0]", "empty"),
    (_record(weights=[1]), "weights", "1 entries for 2 rubric criteria"),
    (_record(weights=[1, -1]), "weights", ">= 0"),
    (_record(weights=[0, 0]), "weights", "positive sum"),
    (_record(tags="mine"), "tags", "list of strings"),
    (_record(level=-1), "level", ">= 0"),
    (_record(input_files={"a.txt": 3}), "input_files", "'a.txt'"),
    (_record(expected_files=["a.txt"]), "expected_files", "{path: text}"),
    (_record(oracle={"steps": [{"args": {}}]}), "oracle.steps", "tool calls"),
    (_record(oracle={"answer": 4}), "oracle.answer", "string"),
]


@pytest.mark.parametrize("rec,field,words", BAD_LINES,
                         ids=[f"{f}:{w[:24]}" for _, f, w in BAD_LINES])
def test_each_invalid_record_is_reported_with_its_line_and_field(rec, field, words, tmp_path,
                                                                 world):
  path = _write_lines(tmp_path / "tasks.jsonl", [_record(id="good"), "", rec])
  with pytest.raises(task_file.TaskFileError) as e:
    task_file.read_jsonl(path)
  line = [p for p in e.value.problems if f"field '{field}'" in p and words in p]
  assert line and line[0].startswith(f"{path}:3: "), e.value.problems


def test_duplicate_ids_non_json_lines_and_every_problem_of_a_file_come_in_one_error(tmp_path,
                                                                                     world):
  path = _write_lines(tmp_path / "tasks.jsonl", [
      _record(), "{not json", "[1, 2]", _record(id="t4", split="dev"), _record()])
  with pytest.raises(task_file.TaskFileError) as e:
    task_file.read_jsonl(path)
  p = e.value.problems
  assert len(p) == 4, p
  assert p[0].startswith(f"{path}:2: not a JSON object")
  assert p[1].startswith(f"{path}:3: not a JSON object (a list)")
  assert p[2].startswith(f"{path}:4: field 'split'")
  assert p[3] == f"{path}:5: field 'id': duplicate id 't1' (first on line 1)"
  assert "4 problems" in str(e.value)


def test_an_empty_file_and_a_missing_file_are_errors(tmp_path):
  with pytest.raises(task_file.TaskFileError, match="holds no task"):
    task_file.read_jsonl(_write_lines(tmp_path / "empty.jsonl", ["", ""]))
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    task_file.read_jsonl(str(tmp_path / "missing.jsonl"))


def test_every_criterion_type_the_grader_knows_is_validated_and_no_other():
  answer_types = {"answer_number", "answer_text", "answer_date", "judge"}
  assert set(task_file.REQUIRED_PARAMS) == set(rubric.WORLD_TYPES) | answer_types


def test_load_tasks_without_a_file_is_exactly_the_generated_split():
  envs_cfg = _cfg()
  for split in tasks_lib.SPLITS:
    assert tasks_lib.load_tasks(envs_cfg, split) == tasks_lib.load_split(envs_cfg, split)
  assert tasks_lib.uses_generated_worlds(envs_cfg)
  with pytest.raises(ValueError, match="split must be one of"):
    tasks_lib.load_tasks(envs_cfg, "test")


def test_load_tasks_gives_a_files_split_in_file_order_and_names_an_empty_split(tmp_path, world):
  recs = [_record(id=i, split=s) for i, s in (("b", "eval"), ("a", "train"), ("c", "eval"))]
  envs_cfg = _cfg(_write_lines(tmp_path / "tasks.jsonl", recs))
  assert [t.id for t in tasks_lib.load_tasks(envs_cfg, "eval")] == ["b", "c"]
  assert [t.id for t in tasks_lib.load_tasks(envs_cfg, "train")] == ["a"]
  assert not tasks_lib.uses_generated_worlds(envs_cfg)
  only_eval = _cfg(_write_lines(tmp_path / "eval_only.jsonl", [_record()]))
  with pytest.raises(ValueError,
                     match=r"no 'train' task \(tasks per split: \{'train': 0, 'eval': 1\}"):
    tasks_lib.load_tasks(only_eval, "train")


def test_a_file_naming_generated_worlds_needs_them_rendered_and_they_must_exist(tmp_path, world):
  envs_cfg = _cfg(_write_lines(tmp_path / "tasks.jsonl", [_record(world_dir=None, world_id="in03"),
                                                         _record(id="t2")]))
  assert tasks_lib.uses_generated_worlds(envs_cfg)
  assert task_file.needs_generated_worlds(tasks_lib.load_tasks(envs_cfg, "eval"))
  bad = _cfg(_write_lines(tmp_path / "bad.jsonl", [_record(world_dir=None, world_id="zz99")]))
  with pytest.raises(ValueError, match=r"generated worlds \['zz99'\]"):
    tasks_lib.load_tasks(bad, "eval")


def test_tasks_format_auto_picks_jsonl_or_archipelago_and_refuses_anything_else(tmp_path, world):
  jsonl = _write_lines(tmp_path / "tasks.jsonl", [_record()])
  assert task_file.resolve_format(_cfg(jsonl)) == "jsonl"
  assert task_file.resolve_format(_cfg(APEX_FIXTURE)) == "archipelago"
  apex = tasks_lib.load_tasks(_cfg(APEX_FIXTURE, worlds_root=str(tmp_path / "cache")), "eval")
  assert [t.id for t in apex][0].startswith("task_") and all(t.world_dir for t in apex)
  # A file of another name: auto refuses, an explicit format reads it.
  other = str(tmp_path / "tasks.txt")
  shutil.copy(jsonl, other)
  with pytest.raises(ValueError, match="neither a \\*.jsonl task file nor an APEX-Agents"):
    tasks_lib.load_tasks(_cfg(other), "eval")
  assert tasks_lib.load_tasks(_cfg(other, "jsonl"), "eval") == task_file.read_jsonl(jsonl)
  with pytest.raises(ValueError, match="neither"):
    tasks_lib.load_tasks(_cfg(str(tmp_path)), "eval")  # a folder without tasks_and_rubrics.json
  with pytest.raises(ValueError, match="envs.tasks_format must be one of"):
    tasks_lib.load_tasks(_cfg(jsonl, "csv"), "eval")
  with pytest.raises(FileNotFoundError, match="envs.tasks_file='/no/such/tasks.jsonl'"):
    tasks_lib.load_tasks(_cfg("/no/such/tasks.jsonl"), "eval")
