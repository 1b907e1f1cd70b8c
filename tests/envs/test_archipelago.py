"""APEX-Agents / Archipelago task folders read as Tasks: the mapping of each field, the world
snapshots (zipped or extracted, with task files overlaid), and the errors of malformed folders."""
import json
import os
import shutil
import zipfile

import openpyxl
import pytest

from configs import tiny_cpu
from envs import tasks as tasks_lib
from envs.tasks import archipelago

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "envs", "fixtures", "archipelago")


def _index(root) -> list:
  with open(os.path.join(root, archipelago.TASKS_INDEX)) as f:
    return json.load(f)


def _files(folder) -> dict:
  out = {}
  for d, _, names in os.walk(folder):
    for n in names:
      with open(os.path.join(d, n)) as f:
        out[os.path.relpath(os.path.join(d, n), folder)] = f.read()
  return out


@pytest.fixture()
def copy(tmp_path):
  """A writable copy of the fixture folder."""
  dst = str(tmp_path / "apex")
  shutil.copytree(FIXTURE, dst)
  return dst


def test_each_apex_task_becomes_a_task_with_judge_criteria_and_its_world_snapshot(tmp_path):
  rows = _index(FIXTURE)
  tasks = archipelago.read_folder(FIXTURE, str(tmp_path))
  assert [t.id for t in tasks] == [r["task_id"] for r in rows]
  for t, r in zip(tasks, rows):
    assert t.prompt == r["prompt"] and t.split == "eval" and t.level == 0
    assert t.domain == archipelago.slug(r["domain"]) and t.family == r["expected_output"]
    assert [c["instruction"] for c in t.rubric] == [c["criteria"] for c in r["rubric"]]
    assert {c["type"] for c in t.rubric} == {"judge"}
    assert [c["verifier_id"] for c in t.rubric] == [c["verifier_id"] for c in r["rubric"]]
    assert (t.oracle_steps, t.oracle_answer, t.world_id, t.weights) == ((), "", "", ())
    assert t.expected_files[archipelago.GOLD_RESPONSE_KEY] == r["gold_response"]
    assert f"world_id:{r['world_id']}" in t.tags and f"task_name:{r['task_name']}" in t.tags
    assert "world_name:Project Halden" in t.tags and "app:mail" in t.tags
  assert [t.domain for t in tasks] == ["investment_banking", "law"]
  # The world snapshot as the zip holds it: the files and the apps' data.
  plain = _files(tasks[0].world_dir)
  zpath = os.path.join(FIXTURE, "world_files_zipped", rows[0]["world_id"] + ".zip")
  with zipfile.ZipFile(zpath) as z:
    assert plain == {n: z.read(n).decode() for n in z.namelist()}
  # The task with input files runs in the snapshot with them overlaid; the snapshot is unchanged.
  with_inputs = _files(tasks[1].world_dir)
  term_sheet = os.path.join("filesystem", "inputs", "term_sheet.txt")
  assert set(with_inputs) == set(plain) | {term_sheet} and term_sheet not in plain
  assert "Maximum leverage: 3.5x" in with_inputs[term_sheet]
  # A gold file is a reference output, by its path, as text.
  assert tasks[1].expected_files["outputs/covenant_memo.txt"].startswith("Financial covenants")


def test_load_tasks_reads_the_folder_as_the_eval_split_and_has_no_train_split(tmp_path):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.envs.tasks_file, c.envs.worlds_root = FIXTURE, str(tmp_path)
  assert tasks_lib.load_tasks(c.envs, "eval") == archipelago.read_folder(FIXTURE, str(tmp_path))
  assert not tasks_lib.uses_generated_worlds(c.envs)
  with pytest.raises(ValueError, match="has no 'train' task"):
    tasks_lib.load_tasks(c.envs, "train")


def test_a_zip_is_extracted_once_and_reused(tmp_path):
  first = archipelago.read_folder(FIXTURE, str(tmp_path))
  marker = os.path.join(first[0].world_dir, "filesystem", "notes", "draft_agenda.txt")
  mtime = os.stat(marker).st_mtime_ns
  again = archipelago.read_folder(FIXTURE, str(tmp_path))
  assert [t.world_dir for t in again] == [t.world_dir for t in first]
  assert os.stat(marker).st_mtime_ns == mtime
  assert not [n for n in os.listdir(os.path.join(str(tmp_path), "archipelago"))
              if n.startswith(".tmp_")]


def test_a_task_file_replacing_a_world_file_leaves_the_shared_snapshot_untouched(copy, tmp_path):
  tid = _index(copy)[1]["task_id"]
  replaced = os.path.join(copy, "task_files", tid, "filesystem", "board", "board_pack_q3_2024.txt")
  os.makedirs(os.path.dirname(replaced))
  with open(replaced, "w") as f:
    f.write("restated: Revenue $400.0m\n")
  a, b = archipelago.read_folder(copy, str(tmp_path / "cache"))
  rel = os.path.join("filesystem", "board", "board_pack_q3_2024.txt")
  assert _files(b.world_dir)[rel] == "restated: Revenue $400.0m\n"
  assert "Revenue: $412.6m" in _files(a.world_dir)[rel]


def test_an_extracted_world_folder_is_used_in_place_of_the_zip(copy, tmp_path):
  wid = _index(copy)[0]["world_id"]
  zpath = os.path.join(copy, "world_files_zipped", wid + ".zip")
  with zipfile.ZipFile(zpath) as z:
    z.extractall(os.path.join(copy, "world_files", wid))
  os.remove(zpath)
  tasks = archipelago.read_folder(copy, str(tmp_path / "cache"))
  assert tasks[0].world_dir == os.path.join(copy, "world_files", wid)


def test_gold_spreadsheets_reach_the_judge_as_text(copy, tmp_path):
  tid = _index(copy)[1]["task_id"]
  wb = openpyxl.Workbook()
  wb.active.title = "Covenants"
  wb.active.append(["Max leverage", 3.5])
  wb.save(os.path.join(copy, "gold_files", tid, "outputs", "covenants.xlsx"))
  (_, t) = archipelago.read_folder(copy, str(tmp_path / "cache"))
  assert t.expected_files["outputs/covenants.xlsx"] == "[sheet Covenants]\nMax leverage\t3.5"


def test_a_malformed_folder_names_each_task_and_field_at_fault(copy, tmp_path):
  rows = _index(copy)
  good = rows[0]
  bad = [dict(good, task_id="task_no_prompt"), dict(good), dict(good, task_id="task_no_world",
                                                                world_id="world_missing"),
         dict(good, task_id="task_bad_rubric", rubric=[{"verifier_id": "v"}]),
         dict(good, task_id="task_no_files", task_input_files=True),
         dict(good, task_id="task_bad_split", split="test")]
  del bad[0]["prompt"]
  with open(os.path.join(copy, archipelago.TASKS_INDEX), "w") as f:
    json.dump([good] + bad, f)
  with pytest.raises(archipelago.ArchipelagoFormatError) as e:
    archipelago.read_folder(copy, str(tmp_path / "cache"))
  p = e.value.problems
  assert p == [
      "tasks_and_rubrics.json: task #1 (task_id 'task_no_prompt'): field 'prompt': missing",
      f"tasks_and_rubrics.json: task #2 (task_id {good['task_id']!r}): field 'task_id': "
      "duplicate task_id (also task #0)",
      "tasks_and_rubrics.json: task #3 (task_id 'task_no_world'): field 'world_id': "
      "'world_missing' is not in world_descriptions.json",
      "tasks_and_rubrics.json: task #4 (task_id 'task_bad_rubric'): field 'rubric[0]': must be an "
      "object with a non-empty 'criteria' string",
      "tasks_and_rubrics.json: task #5 (task_id 'task_no_files'): field 'task_input_files': is set "
      f"but {os.path.join(copy, 'task_files', 'task_no_files')} does not exist",
      "tasks_and_rubrics.json: task #6 (task_id 'task_bad_split'): field 'split': must be one of "
      "('train', 'eval'), got 'test'"], p
  assert "6 problems in the task folder" in str(e.value)


def test_a_missing_snapshot_a_non_array_index_and_an_escaping_zip_are_errors(copy, tmp_path):
  wid = _index(copy)[0]["world_id"]
  os.remove(os.path.join(copy, archipelago.WORLDS_INDEX))  # no index of worlds to check against
  zpath = os.path.join(copy, "world_files_zipped", wid + ".zip")
  os.rename(zpath, zpath + ".bak")
  with pytest.raises(archipelago.ArchipelagoFormatError, match="no snapshot of world"):
    archipelago.read_folder(copy, str(tmp_path / "a"))
  with zipfile.ZipFile(zpath, "w") as z:
    z.writestr("../escape.txt", "x")
  with pytest.raises(archipelago.ArchipelagoFormatError, match="leaves the snapshot"):
    archipelago.read_folder(copy, str(tmp_path / "b"))
  with zipfile.ZipFile(zpath, "w") as z:
    z.writestr("readme.txt", "no filesystem/ here")
  with pytest.raises(archipelago.ArchipelagoFormatError, match="holds neither"):
    archipelago.read_folder(copy, str(tmp_path / "c"))
  with open(os.path.join(copy, archipelago.TASKS_INDEX), "w") as f:
    json.dump({"task_id": "x"}, f)
  with pytest.raises(archipelago.ArchipelagoFormatError, match="must be a JSON array"):
    archipelago.read_folder(copy, str(tmp_path / "d"))
