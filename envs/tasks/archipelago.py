"""APEX-Agents / Archipelago tasks: a folder laid out as the mercor/apex-agents dataset, as Tasks.

  tasks = read_folder("/data/apex-agents", cache_root="runs/worlds")   # [Task], file order

The layout (the dataset's own file and field names, kept as they are):

  tasks_and_rubrics.json        a JSON array, one object per task:
      task_id          the task's id (Task.id)
      task_name        a short title (tag "task_name:<...>")
      domain           the job: "Investment Banking" | "Management Consulting" | "Law" (Task.domain,
                       as a slug: investment_banking, management_consulting, law)
      world_id         the world the task runs in (world_files_zipped/<world_id>.zip)
      prompt           the user message (Task.prompt, unchanged)
      rubric           [{"verifier_id": ..., "criteria": "<a binary criterion>"}, ...], primary
                       objective first; each becomes a `judge` criterion whose instruction is
                       `criteria` (the criterion's other keys are kept on it as they are)
      task_input_files truthy when the task has input files under task_files/<task_id>/
      expected_output  what the task asks for, e.g. "message_in_console" or a file kind (Task.family
                       and tag "expected_output:<...>")
      gold_response    the experts' reference output (Task.expected_files["gold_response"])
      gold_response_type  "text" | "file" (tag)
  world_descriptions.json       optional, a JSON array: world_id, world_name, world_description,
                                apps
  world_files_zipped/<world_id>.zip   the world snapshot: filesystem/ (the files) and .apps_data/
                                (the apps' data: mail, chat, calendar)
  task_files/<task_id>/         per-task input files, overlaid on the world snapshot: filesystem/,
                                .apps_data/ (as the Archipelago runner populates them: world first)
  gold_files/<task_id>/         reference output files of file-output tasks (Task.expected_files,
                                by path, as text)

Every task maps to a Task with world_dir = its world snapshot folder (a copy with the task's
input files overlaid when it has any), rubric = one judge criterion per rubric item (reward = the
share met, passed = all met, as APEX-Agents scores), no oracle (level 0, split "eval").

What the public sources leave open, and what this reader assumes:
  - A snapshot zip holds filesystem/ and/or .apps_data/ at its root, or inside one top folder.
  - world_files/<world_id>/ (an already-extracted snapshot) is used instead of the zip when present.
  - Zips are extracted once into <cache_root>/archipelago/ (keyed by the zip's path, size and
    mtime); tasks with input files get their own world folder there (hard links of the world's
    files plus the task's files), built once.
  - The dataset has no split: every task is "eval" (the APEX-Agents card allows evaluation only).
    A task object may carry an optional "split" ("train" | "eval") for folders of one's own tasks.
  - gold files are shown to a judge as text: text formats as they are, .docx/.pptx/.xlsx/.pdf by
    their text; other formats as a one-line note of their size.
"""
import hashlib
import json
import os
import re
import shutil
import tempfile
import zipfile

from envs.tasks import rubric
from envs.tasks.task import SPLITS, Task

TASKS_INDEX = "tasks_and_rubrics.json"
WORLDS_INDEX = "world_descriptions.json"
WORLD_ZIPS = "world_files_zipped"
WORLD_FOLDERS = "world_files"
TASK_FILES = "task_files"
GOLD_FILES = "gold_files"
SUBSYSTEMS = ("filesystem", ".apps_data")
GOLD_RESPONSE_KEY = "gold_response"


class ArchipelagoFormatError(ValueError):
  """A task folder with problems; `problems` lists each as "<file>: task #<i> (<id>): ..."."""

  def __init__(self, path: str, problems: list):
    self.problems = list(problems)
    head = f"{path}: {len(problems)} problem{'s' if len(problems) != 1 else ''} in the task folder"
    super().__init__(head + "\n  " + "\n  ".join(self.problems))


def is_archipelago_folder(path: str) -> bool:
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, TASKS_INDEX))


def slug(text: str) -> str:
  """'Investment Banking' -> 'investment_banking'."""
  return re.sub(r"[^a-z0-9]+", "_", text.strip().lower()).strip("_")


def _read_array(path: str) -> list:
  with open(path, encoding="utf-8") as f:
    try:
      data = json.load(f)
    except ValueError as e:
      raise ArchipelagoFormatError(path, [f"{path}: not JSON ({e})"]) from e
  if not isinstance(data, list):
    raise ArchipelagoFormatError(path, [f"{path}: must be a JSON array, got "
                                        f"{type(data).__name__}"])
  return data


def _stat_key(*paths) -> str:
  """A short key of files' paths, sizes and mtimes (a folder: every file under it)."""
  h = hashlib.sha256()
  for p in paths:
    files = [p] if os.path.isfile(p) else sorted(
        os.path.join(d, n) for d, _, names in os.walk(p) for n in names)
    for f in files:
      st = os.stat(f)
      h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
  return h.hexdigest()[:12]


def _snapshot_root(folder: str) -> str:
  """The folder holding filesystem/ and .apps_data/: folder itself or its one top folder."""
  if any(os.path.isdir(os.path.join(folder, s)) for s in SUBSYSTEMS):
    return folder
  subs = [e for e in os.listdir(folder) if os.path.isdir(os.path.join(folder, e))]
  if len(subs) == 1 and any(os.path.isdir(os.path.join(folder, subs[0], s)) for s in SUBSYSTEMS):
    return os.path.join(folder, subs[0])
  raise ArchipelagoFormatError(folder, [
      f"{folder}: a world snapshot holds {' or '.join(SUBSYSTEMS)}, and this one holds neither"])


def _build_once(final: str, build) -> str:
  """Runs build(tmp) into a sibling temp folder and renames it to `final`, unless `final` exists
  (another process may build the same folder at the same time: the first rename wins)."""
  if os.path.isdir(final):
    return final
  parent = os.path.dirname(final)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp_")
  try:
    build(tmp)
    os.rename(tmp, final)
  except OSError:
    if not os.path.isdir(final):
      raise
  finally:
    if os.path.isdir(tmp):
      shutil.rmtree(tmp, ignore_errors=True)
  return final


def _extract(zip_path: str, out: str) -> None:
  with zipfile.ZipFile(zip_path) as zf:
    for name in zf.namelist():
      parts = name.replace("\\", "/").split("/")
      if name.startswith("/") or ".." in parts:
        raise ArchipelagoFormatError(zip_path, [f"{zip_path}: member {name!r} leaves the snapshot"])
    zf.extractall(out)


def world_snapshot(root: str, world_id: str, cache_root: str) -> str:
  """The world's snapshot folder (absolute): world_files/<id>/, else the zip extracted once."""
  folder = os.path.join(root, WORLD_FOLDERS, world_id)
  if os.path.isdir(folder):
    return _snapshot_root(os.path.abspath(folder))
  zip_path = os.path.join(root, WORLD_ZIPS, f"{world_id}.zip")
  if not os.path.isfile(zip_path):
    raise FileNotFoundError(f"no snapshot of world {world_id!r}: neither {zip_path} nor {folder}")
  final = os.path.join(os.path.abspath(cache_root), "archipelago",
                       f"{world_id}-{_stat_key(zip_path)}")
  return _snapshot_root(_build_once(final, lambda tmp: _extract(zip_path, tmp)))


def _link_tree(src: str, dst: str) -> None:
  """dst = a copy of src made of hard links (plain copies where links cannot be made)."""
  def link(s, d):
    try:
      os.link(s, d)
    except OSError:
      shutil.copy2(s, d)
  shutil.copytree(src, dst, copy_function=link, symlinks=False)


def _overlay(src: str, dst: str) -> None:
  """Copies src's files over dst; a replaced file is unlinked first (it may be a hard link into
  the pristine world, which must not change)."""
  for d, _, names in os.walk(src):
    rel = os.path.relpath(d, src)
    os.makedirs(os.path.join(dst, rel), exist_ok=True)
    for n in names:
      target = os.path.join(dst, rel, n)
      if os.path.lexists(target):
        os.unlink(target)
      shutil.copy2(os.path.join(d, n), target)


def task_world(world: str, task_files: str, task_id: str, cache_root: str) -> str:
  """A world folder for one task: the snapshot with the task's input files overlaid, built once."""
  key = _stat_key(world, task_files)
  final = os.path.join(os.path.abspath(cache_root), "archipelago", "tasks",
                       f"{slug(task_id) or 'task'}-{key}")

  def build(tmp):
    os.rmdir(tmp)
    _link_tree(world, tmp)
    for s in SUBSYSTEMS:
      if os.path.isdir(os.path.join(task_files, s)):
        _overlay(os.path.join(task_files, s), os.path.join(tmp, s))
  return _build_once(final, build)


def file_text(path: str) -> str:
  """A reference file as text for a judge (envs.tasks.rubric.judge_text); binary data as a note."""
  text = rubric.judge_text(path)
  if "\x00" in text:
    return f"[{os.path.basename(path)}: {os.path.getsize(path)} bytes, no text extracted]"
  return text


def _gold_files(folder: str) -> dict:
  """{path relative to the subsystem folder (filesystem/ when present): text} of the gold files."""
  out = {}
  for d, _, names in sorted(os.walk(folder)):
    for n in sorted(names):
      p = os.path.join(d, n)
      rel = os.path.relpath(p, folder).replace(os.sep, "/")
      if rel.startswith("filesystem/"):
        rel = rel[len("filesystem/"):]
      out[rel] = file_text(p)
  return out


def _task_problems(row, worlds: dict) -> list:
  """(field, problem) pairs of one task object."""
  if not isinstance(row, dict):
    return [("", f"a task must be an object, got {type(row).__name__}")]
  out = []
  for key in ("task_id", "prompt", "world_id", "domain"):
    if not isinstance(row.get(key), str) or not row[key].strip():
      out.append((key, "missing" if key not in row else "must be a non-empty string"))
  rubric = row.get("rubric")
  if not isinstance(rubric, list) or not rubric:
    out.append(("rubric", "missing" if "rubric" not in row else "must be a non-empty list"))
  else:
    for i, c in enumerate(rubric):
      if not (isinstance(c, dict) and isinstance(c.get("criteria"), str) and c["criteria"].strip()):
        out.append((f"rubric[{i}]", "must be an object with a non-empty 'criteria' string"))
  if row.get("split", "eval") not in SPLITS:
    out.append(("split", f"must be one of {SPLITS}, got {row.get('split')!r}"))
  for key in ("task_name", "expected_output", "gold_response", "gold_response_type"):
    if row.get(key) is not None and not isinstance(row[key], str):
      out.append((key, "must be a string"))
  if worlds and isinstance(row.get("world_id"), str) and row["world_id"] not in worlds:
    out.append(("world_id", f"{row['world_id']!r} is not in {WORLDS_INDEX}"))
  return out


def _criterion(c: dict) -> dict:
  out = {"type": "judge", "instruction": c["criteria"], "description": c["criteria"]}
  out.update((k, v) for k, v in c.items() if k not in out and k != "criteria")
  return out


def _tags(row: dict, world: dict) -> tuple:
  tags = ["archipelago", f"world_id:{row['world_id']}"]
  for key, value in (("world_name", world.get("world_name")), ("task_name", row.get("task_name")),
                     ("expected_output", row.get("expected_output")),
                     ("gold_response_type", row.get("gold_response_type"))):
    if isinstance(value, str) and value:
      tags.append(f"{key}:{value}")
  apps = world.get("apps")
  if isinstance(apps, list):
    tags += [f"app:{a}" for a in apps if isinstance(a, str)]
  return tuple(tags)


def read_folder(root: str, cache_root: str) -> list:
  """The tasks of an APEX-Agents/Archipelago task folder, in the order of tasks_and_rubrics.json.

  Args:
    root: the folder (tasks_and_rubrics.json, world_files_zipped/, task_files/, gold_files/, ...).
    cache_root: where zipped snapshots are extracted and per-task worlds built (envs.worlds_root).
  Raises:
    ArchipelagoFormatError: every problem of the folder, each naming the task and the field.
  """
  root = os.path.abspath(root)
  index = os.path.join(root, TASKS_INDEX)
  if not os.path.isfile(index):
    raise FileNotFoundError(f"{root} is not an APEX-Agents/Archipelago task folder: no "
                            f"{TASKS_INDEX}")
  rows = _read_array(index)
  worlds_path = os.path.join(root, WORLDS_INDEX)
  worlds = {}
  if os.path.isfile(worlds_path):
    worlds = {w["world_id"]: w for w in _read_array(worlds_path)
              if isinstance(w, dict) and isinstance(w.get("world_id"), str)}
  problems, seen, snapshots, tasks = [], {}, {}, []
  for i, row in enumerate(rows):
    tid = row.get("task_id") if isinstance(row, dict) else None
    where = f"{TASKS_INDEX}: task #{i}" + (f" (task_id {tid!r})" if isinstance(tid, str) else "")
    found = _task_problems(row, worlds)
    if isinstance(tid, str):
      if tid in seen:
        found.append(("task_id", f"duplicate task_id (also task #{seen[tid]})"))
      seen.setdefault(tid, i)
    if not found:
      wid = row["world_id"]
      if wid not in snapshots:  # the world's snapshot folder, or what is wrong with it
        try:
          snapshots[wid] = world_snapshot(root, wid, cache_root)
        except ArchipelagoFormatError as e:
          snapshots[wid] = ArchipelagoFormatError(root, ["; ".join(e.problems)])
        except (FileNotFoundError, zipfile.BadZipFile) as e:
          snapshots[wid] = ArchipelagoFormatError(root, [f"{type(e).__name__}: {e}"])
      if isinstance(snapshots[wid], ArchipelagoFormatError):
        found.append(("world_id", snapshots[wid].problems[0]))
    task_dir = os.path.join(root, TASK_FILES, tid) if isinstance(tid, str) else ""
    if not found and row.get("task_input_files") and not os.path.isdir(task_dir):
      found.append(("task_input_files", f"is set but {task_dir} does not exist"))
    if found:
      problems += [f"{where}: field '{f}': {p}" if f else f"{where}: {p}" for f, p in found]
      continue
    world = snapshots[row["world_id"]]
    if os.path.isdir(task_dir):
      world = task_world(world, task_dir, tid, cache_root)
    expected = {}
    if row.get("gold_response"):
      expected[GOLD_RESPONSE_KEY] = row["gold_response"]
    gold_dir = os.path.join(root, GOLD_FILES, tid)
    if os.path.isdir(gold_dir):
      expected.update(_gold_files(gold_dir))
    tasks.append(Task(
        id=tid, split=row.get("split", "eval"), domain=slug(row["domain"]), world_id="",
        level=0, family=row.get("expected_output") or "", prompt=row["prompt"], input_files={},
        rubric=tuple(_criterion(c) for c in row["rubric"]), oracle_steps=(), oracle_answer="",
        world_dir=world, expected_files=expected, tags=_tags(row, worlds.get(row["world_id"], {}))))
  if problems:
    raise ArchipelagoFormatError(root, problems)
  if not tasks:
    raise ArchipelagoFormatError(root, [f"{index}: holds no task"])
  return tasks
