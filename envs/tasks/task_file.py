"""Tasks read from files: the JSONL task format, and the reading of envs.tasks_file.

  write_jsonl(tasks, "tasks.jsonl")     # export (generated tasks included)
  tasks = read_jsonl("tasks.jsonl")     # validated; Task objects equal to the exported ones
  every = file_tasks(config.envs)       # envs.tasks_file, JSONL or APEX-Agents folder

Callers take tasks through `envs.tasks.load_tasks(config.envs, split)`. Export of the generated
tasks: `python scripts/export_tasks.py --config=configs/tiny_cpu.py --out=tasks.jsonl`
(docs/own_environment.md).

The JSONL format: one JSON object per line (blank lines are allowed), one task each.

  id              str, required, unique in the file
  split           "train" | "eval", required
  prompt          str, required, non-empty: the user message
  domain          str, required, non-empty (a label: per-domain figures of the eval summary)
  world_id        str: a generated world (e.g. "in03"; must exist under the run's envs.* settings)
  world_dir       str: a folder of files that is the world; a relative path is resolved against the
                  JSONL file's folder and stored absolute. Exactly one of world_id / world_dir.
  rubric          list, required, non-empty: criteria, primary objective first. Each is either
                  a programmatic check of envs/tasks/rubric.py ({"type": "answer_number",
                  "value": 12.5, "decimals": 1}, ...; see REQUIRED_PARAMS) or {"type": "judge",
                  "instruction": "<a natural-language criterion>"}, which a judge model decides.
                  Any criterion may carry a "description"; other keys are kept as they are.
  weights         list of numbers >= 0, optional: per-criterion reward weights in rubric order (same
                  length, positive sum); absent = equal weights
  tags            list of str, optional: free labels
  level           int >= 0, optional (0 = no level): generated tasks' level 1-3; the level filters
                  (loop.levels, loop.eval_levels, sft.levels) keep level-0 tasks always
  family          str, optional: a grouping label (generated tasks: their generator family)
  input_files     {path: text}, optional: files placed in the world before the episode
  expected_files  {path: text}, optional: a reference output (the files a correct episode
                  leaves, or, under the key "gold_response", a reference final answer). Never
                  shown to the agent: a judge sees them as the reference for `judge` criteria.
  oracle          {"steps": [{"name", "args", "expect"}], "answer": str}, optional: tool calls that
                  solve the task and the final answer (replayed by the oracle policy and the SFT
                  warm start). Generated tasks carry one; most tasks written by hand do not.

Unknown fields are errors (a misspelt optional field would otherwise be dropped silently).
`read_jsonl` reports every problem of the file at once, each with its line number and field.
"""
import datetime
import json
import math
import os

from envs import worlds
from envs.tasks import archipelago
from envs.tasks.task import SPLITS, Task

FORMATS = ("auto", "jsonl", "archipelago")
# The key of expected_files holding a reference final answer (not a file).
GOLD_RESPONSE_KEY = archipelago.GOLD_RESPONSE_KEY

# Criterion type -> {required parameter: accepted JSON types}, for every type rubric.check grades.
_NUM = (int, float)
REQUIRED_PARAMS = {
    "answer_number": {"value": _NUM},
    "answer_text": {"text": str},
    "answer_date": {"date": str},
    "mail_sent": {"to": str},
    "mail_count": {"n": int},
    "cell_value": {"path": str, "sheet": str, "cell": str, "value": (int, float, str)},
    "file_contains": {"path": str, "contains": list},
    "slide_added": {"path": str, "title": str},
    "event_booked": {"title": str, "date": str, "start": str},
    "event_count": {"n": int},
    "chat_posted": {"channel": str, "contains": list},
    "unchanged": {"path": str},
    "judge": {"instruction": str},
}
# Optional parameters whose type is checked when present.
_OPTIONAL_PARAMS = {"decimals": int, "sign_free": bool, "subject": str, "contains": list,
                    "attendees": list, "duration_min": int, "description": str}

_FIELDS = ("id", "split", "prompt", "domain", "world_id", "world_dir", "rubric", "weights", "tags",
           "level", "family", "input_files", "expected_files", "oracle")


class TaskFileError(ValueError):
  """A task file with problems; `problems` lists each as "<file>:<line>: field '<f>': <what>"."""

  def __init__(self, path: str, problems: list):
    self.problems = list(problems)
    head = f"{path}: {len(problems)} problem{'s' if len(problems) != 1 else ''} in the task file"
    super().__init__(head + "\n  " + "\n  ".join(self.problems))


def task_to_record(task) -> dict:
  """The JSONL record of a Task (optional fields only when set)."""
  rec = {"id": task.id, "split": task.split, "prompt": task.prompt, "domain": task.domain}
  if task.world_dir:
    rec["world_dir"] = task.world_dir
  else:
    rec["world_id"] = task.world_id
  rec["rubric"] = list(task.rubric)
  for key, value in (("weights", list(task.weights)), ("tags", list(task.tags)),
                     ("level", task.level), ("family", task.family),
                     ("input_files", task.input_files), ("expected_files", task.expected_files)):
    if value:
      rec[key] = value
  if task.oracle_steps or task.oracle_answer:
    rec["oracle"] = {"steps": list(task.oracle_steps), "answer": task.oracle_answer}
  return rec


def write_jsonl(tasks, path: str) -> None:
  """Writes tasks to a JSONL file, one per line, in the order given."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for t in tasks:
      f.write(json.dumps(task_to_record(t), sort_keys=True, ensure_ascii=False) + "\n")


def _is(value, types) -> bool:
  if types is bool:
    return isinstance(value, bool)
  # bool is an int to Python, never a number or a count to a task file.
  return isinstance(value, types) and not isinstance(value, bool)


def _contains_problems(items) -> list:
  out = []
  for j, it in enumerate(items):
    if not isinstance(it, dict) or not (_is(it.get("number"), _NUM) or _is(it.get("text"), str)):
      out.append(f"contains[{j}] must be {{\"number\": v[, \"decimals\": d]}} or "
                 f"{{\"text\": s}}, got {it!r}")
  return out


def criterion_problems(c) -> list:
  """What is wrong with one rubric criterion ([] = nothing)."""
  if not isinstance(c, dict):
    return [f"a criterion must be an object, got {type(c).__name__}"]
  t = c.get("type")
  if t not in REQUIRED_PARAMS:
    return [f"unknown criterion type {t!r}; known: {', '.join(sorted(REQUIRED_PARAMS))}"]
  out = []
  for key, types in REQUIRED_PARAMS[t].items():
    if key not in c:
      out.append(f"a {t} criterion needs {key!r}")
    elif not _is(c[key], types):
      out.append(f"{t}.{key} has the wrong type ({type(c[key]).__name__})")
  for key, types in _OPTIONAL_PARAMS.items():
    if key in c and key not in REQUIRED_PARAMS[t] and not _is(c[key], types):
      out.append(f"{t}.{key} has the wrong type ({type(c[key]).__name__})")
  if isinstance(c.get("contains"), list):
    out += [f"{t}.{p}" for p in _contains_problems(c["contains"])]
  if t == "answer_date" and isinstance(c.get("date"), str):
    try:
      datetime.date.fromisoformat(c["date"])
    except ValueError:
      out.append(f"answer_date.date must be an ISO date (YYYY-MM-DD), got {c['date']!r}")
  if t == "judge" and isinstance(c.get("instruction"), str) and not c["instruction"].strip():
    out.append("judge.instruction is empty")
  return out


def _str_map_problems(value) -> list:
  if not isinstance(value, dict):
    return [f"must be an object {{path: text}}, got {type(value).__name__}"]
  return [f"entry {k!r} must map a path to text" for k, v in value.items()
          if not (isinstance(k, str) and k.strip() and isinstance(v, str))]


def _record_problems(rec: dict, base_dir: str) -> list:
  """(field, problem) pairs of one JSONL record."""
  out = []
  for key in rec:
    if key not in _FIELDS:
      out.append((key, f"unknown field; the fields are {', '.join(_FIELDS)}"))
  for key in ("id", "prompt", "domain"):
    if not isinstance(rec.get(key), str) or not rec[key].strip():
      out.append((key, "missing" if key not in rec else "must be a non-empty string"))
  if rec.get("split") not in SPLITS:
    out.append(("split", f"must be one of {SPLITS}, got {rec.get('split')!r}"))
  has_id, has_dir = "world_id" in rec, "world_dir" in rec
  if has_id == has_dir:
    out.append(("world_id", "give exactly one of world_id (a generated world) and world_dir "
                "(a folder)" + (", not both" if has_id else "")))
  elif has_id and (not isinstance(rec["world_id"], str) or not rec["world_id"].strip()):
    out.append(("world_id", "must be a non-empty string"))
  elif has_dir:
    d = rec["world_dir"]
    if not isinstance(d, str) or not d.strip():
      out.append(("world_dir", "must be a non-empty string"))
    elif not os.path.isdir(os.path.join(base_dir, d)):
      out.append(("world_dir", f"no such folder: {os.path.abspath(os.path.join(base_dir, d))}"))
  rubric = rec.get("rubric")
  if not isinstance(rubric, list) or not rubric:
    out.append(("rubric", "missing" if "rubric" not in rec else "must be a non-empty list"))
  else:
    for i, c in enumerate(rubric):
      out += [(f"rubric[{i}]", p) for p in criterion_problems(c)]
  if "weights" in rec:
    w = rec["weights"]
    if (not isinstance(w, list) or not all(_is(x, _NUM) and math.isfinite(x) and x >= 0 for x in w)
        or not sum(w) > 0):
      out.append(("weights", "must be a list of finite numbers >= 0 with a positive sum"))
    elif isinstance(rubric, list) and len(w) != len(rubric):
      out.append(("weights", f"has {len(w)} entries for {len(rubric)} rubric criteria"))
  if "tags" in rec and (not isinstance(rec["tags"], list)
                        or not all(isinstance(x, str) for x in rec["tags"])):
    out.append(("tags", "must be a list of strings"))
  if "level" in rec and not (_is(rec["level"], int) and rec["level"] >= 0):
    out.append(("level", f"must be an integer >= 0, got {rec['level']!r}"))
  if "family" in rec and not isinstance(rec["family"], str):
    out.append(("family", "must be a string"))
  for key in ("input_files", "expected_files"):
    if key in rec:
      out += [(key, p) for p in _str_map_problems(rec[key])]
  if "oracle" in rec:
    o = rec["oracle"]
    if not isinstance(o, dict) or set(o) - {"steps", "answer"}:
      out.append(("oracle", "must be an object {\"steps\": [...], \"answer\": str}"))
    else:
      steps = o.get("steps", [])
      if not isinstance(steps, list) or not all(
          isinstance(s, dict) and isinstance(s.get("name"), str)
          and isinstance(s.get("args", {}), dict) for s in steps):
        out.append(("oracle.steps", "must be a list of tool calls {\"name\": str, \"args\": {...}, "
                    "\"expect\": [...]}"))
      if not isinstance(o.get("answer", ""), str):
        out.append(("oracle.answer", "must be a string"))
  return out


def record_to_task(rec: dict, base_dir: str):
  """A Task from a validated record; a relative world_dir is resolved against base_dir."""
  oracle = rec.get("oracle", {})
  world_dir = rec.get("world_dir", "")
  if world_dir:
    world_dir = os.path.abspath(os.path.join(base_dir, world_dir))
  return Task(
      id=rec["id"], split=rec["split"], domain=rec["domain"], world_id=rec.get("world_id", ""),
      level=int(rec.get("level", 0)), family=rec.get("family", ""), prompt=rec["prompt"],
      input_files=dict(rec.get("input_files", {})), rubric=tuple(rec["rubric"]),
      oracle_steps=tuple(oracle.get("steps", ())), oracle_answer=oracle.get("answer", ""),
      world_dir=world_dir, expected_files=dict(rec.get("expected_files", {})),
      tags=tuple(rec.get("tags", ())), weights=tuple(rec.get("weights", ())))


def read_jsonl(path: str) -> list:
  """The tasks of a JSONL task file, in file order.

  Raises:
    FileNotFoundError: no such file.
    TaskFileError: every problem of the file, each naming its line and field.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"task file {path!r} does not exist")
  base_dir = os.path.dirname(os.path.abspath(path))
  problems, tasks, first_line = [], [], {}
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")  # not splitlines: a JSON string may hold U+2028 as it is
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except ValueError as e:
      problems.append(f"{path}:{n}: not a JSON object ({e})")
      continue
    if not isinstance(rec, dict):
      problems.append(f"{path}:{n}: not a JSON object (a {type(rec).__name__})")
      continue
    found = _record_problems(rec, base_dir)
    problems += [f"{path}:{n}: field '{fld}': {p}" for fld, p in found]
    tid = rec.get("id")
    if isinstance(tid, str):
      if tid in first_line:
        problems.append(f"{path}:{n}: field 'id': duplicate id {tid!r} (first on line "
                        f"{first_line[tid]})")
      else:
        first_line[tid] = n
    if not found:
      tasks.append(record_to_task(rec, base_dir))
  if problems:
    raise TaskFileError(path, problems)
  if not tasks:
    raise TaskFileError(path, [f"{path}: holds no task"])
  return tasks


def resolve_format(envs_cfg) -> str:
  """jsonl | archipelago: envs.tasks_format, or with `auto` what envs.tasks_file is."""
  path, fmt = envs_cfg.tasks_file, envs_cfg.tasks_format
  if fmt not in FORMATS:
    raise ValueError(f"envs.tasks_format must be one of {FORMATS}, got {fmt!r}")
  if not os.path.exists(path):
    raise FileNotFoundError(f"envs.tasks_file={path!r} does not exist")
  if fmt != "auto":
    return fmt
  if os.path.isfile(path) and path.endswith(".jsonl"):
    return "jsonl"
  if archipelago.is_archipelago_folder(path):
    return "archipelago"
  raise ValueError(
      f"envs.tasks_file={path!r} is neither a *.jsonl task file nor an APEX-Agents/Archipelago "
      f"task folder (one holding {archipelago.TASKS_INDEX}); set envs.tasks_format=jsonl or "
      "archipelago to say which it is")


def file_tasks(envs_cfg) -> list:
  """Every task of envs.tasks_file (both splits), in file order, checked against the run's
  generated worlds where a task names one."""
  fmt = resolve_format(envs_cfg)
  path = envs_cfg.tasks_file
  if fmt == "jsonl":
    tasks = read_jsonl(path)
  else:
    tasks = archipelago.read_folder(path, envs_cfg.worlds_root)
  wids = sorted({t.world_id for t in tasks if not t.world_dir})
  if wids:
    known = set(worlds.all_specs(envs_cfg))
    unknown = [w for w in wids if w not in known]
    if unknown:
      raise ValueError(f"envs.tasks_file={path!r} names generated worlds {unknown} that these "
                       f"envs settings do not generate (they are {sorted(known)})")
  return tasks


def split_of(tasks, split: str, source: str) -> list:
  """The tasks of `split`, in order; an error naming `source` when there is none."""
  out = [t for t in tasks if t.split == split]
  if not out:
    counts = {s: sum(t.split == s for t in tasks) for s in SPLITS}
    raise ValueError(f"envs.tasks_file={source!r} has no {split!r} task (tasks per split: "
                     f"{counts})")
  return out


def needs_generated_worlds(tasks) -> bool:
  """Whether some task runs in a generated world (so worlds.ensure_worlds must render them)."""
  return any(not t.world_dir for t in tasks)


def has_oracle(task) -> bool:
  """Whether the task carries an oracle (steps or an answer) to replay."""
  return bool(task.oracle_steps or task.oracle_answer)
