"""Rubric criteria, checked by code against the final answer and the world before/after.

A criterion is a JSON-able dict {"type": ..., "description": ..., **params}. The first one of
a task's rubric is its primary objective. `grade()` returns reward = share of criteria passed
and passed = all of them passed (what Pass@1 counts).

Types:
  answer_number  value, decimals, sign_free   the final answer states the number
  answer_text    text                          the final answer contains the text
  answer_date    date (ISO)                    the final answer gives the date (ISO or words)
  mail_sent      to, contains[], subject?      a new sent e-mail to `to` holding every item
  mail_count     n                             exactly n e-mails were sent in the episode
  cell_value     path, sheet, cell, value      a workbook cell holds the value
  file_contains  path, contains[]              a text file exists and holds every item
  slide_added    path, title, contains[]       the deck gained a slide with that title/items
  event_booked   title, date, start, duration_min?, attendees[]
  event_count    n                             exactly n events were added
  chat_posted    channel, contains[]           a new message in the channel holds every item
  unchanged      path                          a file is byte-identical to before
  judge          instruction                   a judge model decides (envs/judge.py)
Items in `contains` are {"number": v, "decimals": d} or {"text": s}.

Reward = the criteria met, weighted by the task's `weights` when it has them (else equally), over
the total weight. A judge criterion the judge could not decide (a malformed or failed reply after
its retries) is not met; its detail starts with `judge_error`. Inside `envs.judge.deferred`,
`grade` submits the judge criteria and returns at once with them not met (detail
`judge pending`), leaving an `envs.judge.Pending` whose result is the final grade.

The world after the episode is the agent's work: an app file or document it left unreadable
(malformed JSON, a broken workbook, a missing apps/*.json; easy with the shell tool style,
which edits apps/*.json directly) fails the criteria that read it, with the error as detail.
"""
import dataclasses
import datetime
import functools
import json
import os
import re

from envs import judge as judge_lib
from envs.judge import JudgeUnavailable  # noqa: F401 - re-exported (envs.tasks)

_NUM_RE = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w.])-?\d+(?:\.\d+)?")


@dataclasses.dataclass
class CriterionResult:
  description: str
  passed: bool
  detail: str = ""


@dataclasses.dataclass
class GradeResult:
  reward: float           # weighted share of criteria passed (task.weights; equal without), in [0, 1]
  passed: bool            # every criterion passed
  results: list           # [CriterionResult], rubric order


def numbers_in(text: str) -> list:
  """Numbers written in free text ('1,234.5', '-3', '12%') as floats, in order."""
  return [float(m.group(0).replace(",", "")) for m in _NUM_RE.finditer(text or "")]


def number_matches(text: str, value: float, decimals: int, rel_tol: float, max_numbers: int,
                   sign_free: bool = False) -> bool:
  nums = numbers_in(text)
  if not nums or len(set(nums)) > max_numbers:
    return False
  tol = max(rel_tol * abs(value), 0.5 * 10 ** (-decimals) + 1e-9)
  targets = (value, -value) if sign_free else (value,)
  return any(abs(n - t) <= tol for n in nums for t in targets)


def _date_forms(iso: str) -> list:
  d = datetime.date.fromisoformat(iso)
  month = d.strftime("%B")
  return [iso.lower(), f"{month} {d.day}, {d.year}".lower(), f"{d.day} {month} {d.year}".lower(),
          f"{month} {d.day} {d.year}".lower(), f"{d.strftime('%b')} {d.day}, {d.year}".lower(),
          f"{d.day} {d.strftime('%b')} {d.year}".lower(), d.strftime("%m/%d/%Y")]


def _contains_all(text: str, items: list, cfg) -> bool:
  for it in items:
    if "number" in it:
      if not number_matches(text, it["number"], it.get("decimals", 2), cfg.answer_rel_tol,
                            max(cfg.max_numbers_in_answer, 32)):
        return False
    elif it["text"].lower() not in (text or "").lower():
      return False
  return True


def _json(root, app):
  with open(os.path.join(root, "apps", f"{app}.json")) as f:
    return json.load(f)


def _new(before: list, after: list, key="id") -> list:
  seen = {x[key] for x in before}
  return [x for x in after if x[key] not in seen]


def _file(root, rel):
  return os.path.join(root, "files", rel.lstrip("/"))


def _doc_text(path: str) -> str:
  low = path.lower()
  if low.endswith(".docx"):
    import docx  # lazy: document library, for a criterion on that format
    return "\n".join(p.text for p in docx.Document(path).paragraphs)
  if low.endswith(".pptx"):
    from pptx import Presentation  # lazy: document library, for a criterion on that format
    return "\n".join(sh.text_frame.text for s in Presentation(path).slides for sh in s.shapes
                     if sh.has_text_frame)
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def judge_text(path: str) -> str:
  """A file's text as a judge is shown it: documents and decks as for file_contains (plus a
  document's tables, one tab-separated line per row), workbooks as one tab-separated line per row
  under a line per sheet, PDFs through pypdf; other files as text (binary data keeps its NULs, for
  the caller to tell)."""
  low = path.lower()
  if low.endswith((".xlsx", ".xlsm")):
    import openpyxl  # lazy: document library, for a file of that format
    wb = openpyxl.load_workbook(path, data_only=True, read_only=True)
    lines = []
    for ws in wb.worksheets:
      lines.append(f"[sheet {ws.title}]")
      lines += ["\t".join("" if v is None else str(v) for v in row)
                for row in ws.iter_rows(values_only=True)]
    wb.close()
    return "\n".join(lines)
  if low.endswith(".docx"):
    import docx  # lazy: document library, for a file of that format
    d = docx.Document(path)
    rows = ["\t".join(c.text for c in r.cells) for t in d.tables for r in t.rows]
    return "\n".join([p.text for p in d.paragraphs] + rows)
  if low.endswith(".pdf"):
    import pypdf  # lazy: PDF library, for a file of that format
    return "\n".join(p.extract_text() or "" for p in pypdf.PdfReader(path).pages)
  return _doc_text(path)


@functools.lru_cache(maxsize=256)
def _slide_count(path: str, mtime_ns: int, size: int) -> int:
  """Slides of a (pristine) deck; cached because every graded episode of a world reads it."""
  del mtime_ns, size  # cache key only
  from pptx import Presentation  # lazy: document library, for a criterion on that format
  return len(Presentation(path).slides)


# Criteria that read the world's files (the others read the final answer or ask a judge).
WORLD_TYPES = ("mail_sent", "mail_count", "cell_value", "file_contains", "slide_added",
               "event_booked", "event_count", "chat_posted", "unchanged")


def check(c: dict, answer: str, before: str, after: str, cfg) -> CriterionResult:
  """One criterion. `before`/`after` are world directories (files/ + apps/)."""
  if c["type"] not in WORLD_TYPES:
    return _check(c, answer, before, after, cfg)
  try:
    return _check(c, answer, before, after, cfg)
  except Exception as e:  # noqa: BLE001 - any way the agent broke a file fails the criterion
    return CriterionResult(c.get("description", c["type"]), False,
                           f"world state unreadable: {type(e).__name__}: {str(e)[:200]}")


def _check(c: dict, answer: str, before: str, after: str, cfg) -> CriterionResult:
  t = c["type"]
  desc = c.get("description", t)
  ok, detail = False, ""
  if t == "answer_number":
    ok = number_matches(answer, c["value"], c.get("decimals", 2), cfg.answer_rel_tol,
                        cfg.max_numbers_in_answer, c.get("sign_free", False))
  elif t == "answer_text":
    ok = c["text"].lower() in (answer or "").lower()
  elif t == "answer_date":
    low = (answer or "").lower()
    ok = any(f in low for f in _date_forms(c["date"]))
  elif t in ("mail_sent", "mail_count"):
    sent = [m for m in _new(_json(before, "mail")["messages"], _json(after, "mail")["messages"])
            if m["folder"] == "sent"]
    if t == "mail_count":
      ok, detail = len(sent) == c["n"], f"{len(sent)} sent"
    else:
      for m in sent:
        if c["to"].lower() not in [a.lower() for a in m["to"] + m.get("cc", [])]:
          continue
        if c.get("subject") and c["subject"].lower() not in m["subject"].lower():
          continue
        if _contains_all(m["subject"] + "\n" + m["body"], c.get("contains", []), cfg):
          ok = True
      detail = f"{len(sent)} new e-mails"
  elif t == "cell_value":
    import openpyxl  # lazy: document library, for a criterion on that format
    p = _file(after, c["path"])
    if os.path.exists(p):
      wb = openpyxl.load_workbook(p, data_only=True)
      if c["sheet"] in wb.sheetnames:
        v = wb[c["sheet"]][c["cell"]].value
        detail = f"cell holds {v!r}"
        if isinstance(c["value"], (int, float)):
          ok = v is not None and number_matches(str(v), c["value"], c.get("decimals", 2),
                                                cfg.answer_rel_tol, 1, c.get("sign_free", False))
        else:
          ok = str(v or "").strip().lower() == str(c["value"]).lower()
  elif t == "file_contains":
    p = _file(after, c["path"])
    ok = os.path.isfile(p) and _contains_all(_doc_text(p), c.get("contains", []), cfg)
  elif t == "slide_added":
    from pptx import Presentation  # lazy: document library, for a criterion on that format
    p_before, p_after = _file(before, c["path"]), _file(after, c["path"])
    if os.path.isfile(p_after):
      st = os.stat(p_before)
      n0 = _slide_count(p_before, st.st_mtime_ns, st.st_size)
      slides = list(Presentation(p_after).slides)
      detail = f"{len(slides) - n0} slides added"
      for s in slides[n0:]:
        title = s.shapes.title.text if s.shapes.title is not None else ""
        text = "\n".join(sh.text_frame.text for sh in s.shapes if sh.has_text_frame)
        if c["title"].lower() in title.lower() and _contains_all(text, c.get("contains", []), cfg):
          ok = True
  elif t in ("event_booked", "event_count"):
    new = _new(_json(before, "calendar")["events"], _json(after, "calendar")["events"])
    if t == "event_count":
      ok, detail = len(new) == c["n"], f"{len(new)} new events"
    else:
      for e in new:
        if (c["title"].lower() in e["title"].lower() and e["date"] == c["date"] and
            e["start"] == c["start"] and
            ("duration_min" not in c or e["duration_min"] == c["duration_min"]) and
            {a.lower() for a in c.get("attendees", [])} <= {a.lower() for a in e["attendees"]}):
          ok = True
  elif t == "chat_posted":
    b = _json(before, "chat")["channels"].get(c["channel"], [])
    a = _json(after, "chat")["channels"].get(c["channel"], [])
    ok = any(_contains_all(m["text"], c.get("contains", []), cfg) for m in _new(b, a))
  elif t == "unchanged":
    pb, pa = _file(before, c["path"]), _file(after, c["path"])
    if os.path.isfile(pa):
      with open(pb, "rb") as f1, open(pa, "rb") as f2:
        ok = f1.read() == f2.read()
  elif t == "judge":
    raise ValueError("judge criteria are graded by rubric.grade (the judge needs the task)")
  else:
    raise ValueError(f"unknown criterion type {t!r}")
  return CriterionResult(desc, bool(ok), detail)


def grade(task, final_answer: str, before_dir: str, after_dir: str, envs_cfg) -> GradeResult:
  """Grades one episode.

  Args:
    task: an envs.tasks.Task (its rubric is used).
    final_answer: the agent's final message ('' when it gave none).
    before_dir: the world as the episode started (pristine world; input files do not matter).
    after_dir: the world's working copy after the episode.
  Returns:
    GradeResult(reward in [0, 1], passed, per-criterion results).
  """
  answer = final_answer or ""
  weights = rubric_weights(task)
  res = [None if c["type"] == "judge" else check(c, answer, before_dir, after_dir, envs_cfg)
         for c in task.rubric]
  judged = [i for i, c in enumerate(task.rubric) if c["type"] == "judge"]
  if not judged:
    return _total(res, weights)
  judge = judge_lib.for_config(envs_cfg.judge)  # JudgeUnavailable without an endpoint
  # Read now: the working copy is reset for the next episode before deferred verdicts arrive.
  files = judge_lib.world_changes(before_dir, after_dir, task.input_files, judge_text)
  criteria = [task.rubric[i] for i in judged]

  def finish(verdicts: list) -> GradeResult:
    out = list(res)
    for i, v in zip(judged, verdicts):
      out[i] = _judged(task.rubric[i], v)
    return _total(out, weights)

  sink = judge_lib.deferring()
  if sink is None:
    return finish(judge.grade_all(task, criteria, answer, files))
  futures = [judge.submit(task, c, answer, files) for c in criteria]

  def update(verdicts: list) -> dict:
    g = finish(verdicts)
    return dict(reward=g.reward, passed=g.passed, judge_error=judge_errors(g.results),
                criteria={i: dataclasses.asdict(g.results[i]) for i in judged})
  sink.append(judge_lib.Pending(futures, update))
  provisional = list(res)
  for i in judged:
    provisional[i] = CriterionResult(task.rubric[i].get("description", "judge"), False,
                                     "judge pending")
  return _total(provisional, weights)


def rubric_weights(task) -> tuple:
  """The task's per-criterion weights (rubric order), or () for equal weights."""
  w = tuple(getattr(task, "weights", ()) or ())
  if not w:
    return ()
  if len(w) != len(task.rubric):
    raise ValueError(f"task {task.id}: {len(w)} weights for {len(task.rubric)} criteria")
  if any(not isinstance(x, (int, float)) or x < 0 for x in w) or sum(w) <= 0:
    raise ValueError(f"task {task.id}: weights must be >= 0 with a positive sum, got {w}")
  return tuple(float(x) for x in w)


def _judged(c: dict, v) -> CriterionResult:
  desc = c.get("description", "judge")
  if v.met is None:
    return CriterionResult(desc, False, v.error)
  return CriterionResult(desc, bool(v.met), v.reason[:500])


def judge_errors(results) -> int:
  """Criteria the judge could not decide (their detail starts with `judge_error`)."""
  return sum(str(r.detail).startswith(judge_lib.JUDGE_ERROR) for r in results)


def _total(res: list, weights: tuple) -> GradeResult:
  if not weights:
    n = sum(r.passed for r in res)
    return GradeResult(reward=n / len(res), passed=n == len(res), results=res)
  got = sum(w for w, r in zip(weights, res) if r.passed)
  return GradeResult(reward=got / sum(weights), passed=all(r.passed for r in res), results=res)
