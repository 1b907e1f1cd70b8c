"""The apps of a world as plain Python: nine apps, each a set of typed tool functions.

`WorldTools(world_dir, envs_cfg)` binds the tools to one world directory (files/ + apps/).
The MCP gateway (`envs.apps.server`) registers exactly these methods, so the JSON schemas the
model sees come from the type hints below, and the in-process `LocalClient` runs the same
code. Every tool returns text; a failure raises `ToolFailure` whose `kind` names the error:

  path_outside_world | not_found | bad_argument | unsupported | timeout | internal

All app state is on disk (apps/*.json and the files), re-read on each call, so resetting a
world is a matter of restoring files (see `envs.apps.worldstate`).
"""
import datetime
import fnmatch
import inspect
import json
import os
import re
import threading

from envs import sandbox

APPS = ("filesystem", "documents", "pdfs", "spreadsheets", "presentations", "mail", "chat",
        "calendar", "code_execution")
TEXT_EXT = (".txt", ".md", ".csv", ".json", ".py", ".log")


class ToolFailure(Exception):
  """A tool error the agent should see (is_error=True), with a taxonomy `kind`."""

  def __init__(self, kind: str, message: str):
    super().__init__(f"[{kind}] {message}")
    self.kind = kind


class WorldTools:
  """Tools of one world. Thread-safe: calls are serialised by a lock (one episode at a time)."""

  # (app, method) pairs exposed as tools named f"{app}_{method}".
  TOOL_NAMES = (
      "filesystem_list_directory", "filesystem_search_files", "filesystem_read_text_file",
      "filesystem_write_text_file",
      "documents_read_document", "documents_create_document",
      "pdfs_read_pdf", "pdfs_search_pdfs",
      "spreadsheets_list_sheets", "spreadsheets_read_sheet", "spreadsheets_write_cell",
      "presentations_read_presentation", "presentations_add_slide",
      "mail_list_contacts", "mail_list_messages", "mail_read_message", "mail_search_messages",
      "mail_send_message",
      "chat_list_channels", "chat_read_channel", "chat_post_message",
      "calendar_list_events", "calendar_create_event",
      "code_execution_run_python",
  )

  def __init__(self, world_dir: str, envs_cfg):
    self.world_dir = os.path.realpath(world_dir)
    self.files = os.path.join(self.world_dir, "files")
    self.apps = os.path.join(self.world_dir, "apps")
    self.cfg = envs_cfg
    self.lock = threading.RLock()
    # Set by the server when a call outlives its time limit: stops a running sandbox.
    self.cancel = threading.Event()
    self._cache = {}  # (kind, path) -> ((mtime_ns, size), text): parsed documents

  # ---- helpers -------------------------------------------------------------------------------
  def resolve(self, path: str, must_exist: bool = True) -> str:
    """Maps an agent path ("models/x.xlsx" or "/models/x.xlsx") to a real path inside files/."""
    if not isinstance(path, str) or "\x00" in path:
      raise ToolFailure("bad_argument", "path must be a string")
    rel = path.strip()
    if rel.startswith(self.files):
      rel = rel[len(self.files):]
    rel = rel.lstrip("/") or "."
    real = os.path.realpath(os.path.join(self.files, rel))
    if real != self.files and not real.startswith(self.files + os.sep):
      raise ToolFailure("path_outside_world",
                        f"{path!r} is outside the world's files; paths are relative to its root '/'")
    if must_exist and not os.path.exists(real):
      raise ToolFailure("not_found", f"no such file or directory: {path!r}")
    return real

  def rel(self, real: str) -> str:
    rel = os.path.relpath(real, self.files).replace(os.sep, "/")
    return "/" if rel == "." else "/" + rel

  def _cached(self, kind: str, real: str, parse):
    st = os.stat(real)
    key = (kind, real)
    hit = self._cache.get(key)
    if hit and hit[0] == (st.st_mtime_ns, st.st_size):
      return hit[1]
    val = parse(real)
    self._cache[key] = ((st.st_mtime_ns, st.st_size), val)
    return val

  def _ext(self, real: str, exts, app: str):
    if not real.lower().endswith(exts):
      raise ToolFailure("unsupported", f"{app} handles {', '.join(exts)} files, not {self.rel(real)}")
    if not os.path.isfile(real):
      raise ToolFailure("not_found", f"not a file: {self.rel(real)}")

  def _load(self, app: str) -> dict:
    with open(os.path.join(self.apps, f"{app}.json")) as f:
      return json.load(f)

  def _save(self, app: str, data: dict):
    path = os.path.join(self.apps, f"{app}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(data, f, indent=1, sort_keys=True)
      f.write("\n")
    os.replace(tmp, path)

  # ---- filesystem ----------------------------------------------------------------------------
  def filesystem_list_directory(self, path: str = "/") -> str:
    """List the files and folders in a folder of the world (paths are relative to '/')."""
    real = self.resolve(path)
    if not os.path.isdir(real):
      raise ToolFailure("bad_argument", f"not a directory: {path!r}")
    lines = []
    for name in sorted(os.listdir(real)):
      p = os.path.join(real, name)
      lines.append(f"{name}/" if os.path.isdir(p) else f"{name}\t{os.path.getsize(p)} bytes")
    return f"{self.rel(real)}:\n" + ("\n".join(lines) if lines else "(empty)")

  def filesystem_search_files(self, pattern: str, path: str = "/") -> str:
    """Find files whose name matches a glob pattern (e.g. '*.xlsx') or contains the text, recursively."""
    real = self.resolve(path)
    pat = pattern.lower()
    hits = []
    for d, dirs, names in os.walk(real):
      dirs.sort()
      for n in sorted(names):
        if fnmatch.fnmatch(n.lower(), pat) or pat in n.lower():
          hits.append(self.rel(os.path.join(d, n)))
    return "\n".join(hits) if hits else f"no files match {pattern!r}"

  def filesystem_read_text_file(self, path: str) -> str:
    """Read a plain-text file (.txt, .md, .csv, .json, .py, .log)."""
    real = self.resolve(path)
    self._ext(real, TEXT_EXT, "filesystem_read_text_file")
    with open(real, encoding="utf-8", errors="replace") as f:
      return f.read()

  def filesystem_write_text_file(self, path: str, content: str) -> str:
    """Create or overwrite a plain-text file; parent folders are created."""
    real = self.resolve(path, must_exist=False)
    if not real.lower().endswith(TEXT_EXT):
      raise ToolFailure("unsupported", f"only text files can be written here: {path!r}")
    os.makedirs(os.path.dirname(real), exist_ok=True)
    with open(real, "w", encoding="utf-8") as f:
      f.write(content)
    return f"wrote {len(content)} characters to {self.rel(real)}"

  # ---- documents (docx) ----------------------------------------------------------------------
  def documents_read_document(self, path: str) -> str:
    """Read a Word document (.docx): its paragraphs, then its tables as rows."""
    real = self.resolve(path)
    self._ext(real, (".docx",), "documents")

    def parse(p):
      import docx  # lazy: document library (see _workbook)
      d = docx.Document(p)
      out = [para.text for para in d.paragraphs if para.text.strip()]
      for ti, t in enumerate(d.tables):
        out.append(f"[table {ti + 1}]")
        out += [" | ".join(c.text for c in row.cells) for row in t.rows]
      return "\n".join(out)
    return self._cached("docx", real, parse)

  def documents_create_document(self, path: str, title: str, paragraphs: list[str]) -> str:
    """Create a Word document (.docx) with a title and paragraphs."""
    real = self.resolve(path, must_exist=False)
    if not real.lower().endswith(".docx"):
      raise ToolFailure("unsupported", "path must end in .docx")
    import docx  # lazy: document library (see _workbook)
    d = docx.Document()
    d.add_heading(title, level=1)
    for p in paragraphs:
      d.add_paragraph(str(p))
    os.makedirs(os.path.dirname(real), exist_ok=True)
    d.save(real)
    return f"created {self.rel(real)} ({len(paragraphs)} paragraphs)"

  # ---- pdfs ----------------------------------------------------------------------------------
  def _pdf_pages(self, real: str) -> list:
    def parse(p):
      import pypdf  # lazy: document library (see _workbook)
      return [pg.extract_text() or "" for pg in pypdf.PdfReader(p).pages]
    return self._cached("pdf", real, parse)

  def pdfs_read_pdf(self, path: str, first_page: int = 1, last_page: int = 0) -> str:
    """Extract the text of a PDF, pages first_page..last_page (1-based; last_page 0 = to the end)."""
    real = self.resolve(path)
    self._ext(real, (".pdf",), "pdfs")
    pages = self._pdf_pages(real)
    last = len(pages) if last_page <= 0 else min(last_page, len(pages))
    if first_page < 1 or first_page > max(last, 1):
      raise ToolFailure("bad_argument", f"page range {first_page}..{last_page} outside 1..{len(pages)}")
    return "\n".join(f"--- page {i} of {len(pages)} ---\n{pages[i - 1]}"
                     for i in range(first_page, last + 1))

  def pdfs_search_pdfs(self, query: str, path: str = "/") -> str:
    """Search every PDF under a folder for a text (case-insensitive); returns matching lines."""
    real = self.resolve(path)
    q = query.lower()
    hits = []
    for d, dirs, names in os.walk(real):
      dirs.sort()
      for n in sorted(names):
        if n.lower().endswith(".pdf"):
          p = os.path.join(d, n)
          for i, text in enumerate(self._pdf_pages(p)):
            hits += [f"{self.rel(p)} p{i + 1}: {ln}" for ln in text.splitlines() if q in ln.lower()]
    return "\n".join(hits) if hits else f"no PDF line contains {query!r}"

  # ---- spreadsheets --------------------------------------------------------------------------
  def _workbook(self, real: str, data_only: bool = True):
    # Imported at first use, like the other file readers (docx, pypdf, pptx): importing openpyxl
    # is ~0.14 s of CPU, paid by every world start otherwise (each gateway process imports this
    # module), whether or not the episode opens a workbook.
    import openpyxl  # lazy: document library (see _workbook)
    return openpyxl.load_workbook(real, data_only=data_only)

  def spreadsheets_list_sheets(self, path: str) -> str:
    """List the sheets of a workbook (.xlsx) with their used ranges."""
    real = self.resolve(path)
    self._ext(real, (".xlsx",), "spreadsheets")
    wb = self._workbook(real)
    return "\n".join(f"{ws.title}\t{ws.dimensions}" for ws in wb.worksheets)

  def spreadsheets_read_sheet(self, path: str, sheet: str = "", max_rows: int = 200) -> str:
    """Read a sheet of a workbook (.xlsx) as rows 'row N: A=.. | B=..' (sheet '' = first sheet)."""
    real = self.resolve(path)
    self._ext(real, (".xlsx",), "spreadsheets")

    def parse(p):
      wb = self._workbook(p)
      return {ws.title: [list(r) for r in ws.iter_rows(values_only=True)] for ws in wb.worksheets}
    sheets = self._cached("xlsx", real, parse)
    name = sheet or next(iter(sheets))
    if name not in sheets:
      raise ToolFailure("not_found", f"no sheet {sheet!r}; sheets: {', '.join(sheets)}")
    out = [f"sheet {name} of {self.rel(real)}"]
    from openpyxl.utils import cell as cell_utils  # lazy: document library (see _workbook)
    for i, row in enumerate(sheets[name][:max_rows]):
      cells = [f"{cell_utils.get_column_letter(j + 1)}={v}" for j, v in enumerate(row) if v is not None]
      if cells:
        out.append(f"row {i + 1}: " + " | ".join(cells))
    return "\n".join(out)

  def spreadsheets_write_cell(self, path: str, sheet: str, cell: str, value: str) -> str:
    """Write a value into one cell (e.g. 'B3') of a workbook sheet; numbers are stored as numbers."""
    real = self.resolve(path)
    self._ext(real, (".xlsx",), "spreadsheets")
    if not re.fullmatch(r"[A-Za-z]{1,3}[1-9][0-9]{0,5}", cell or ""):
      raise ToolFailure("bad_argument", f"not a cell reference: {cell!r}")
    wb = self._workbook(real, data_only=False)
    if sheet not in wb.sheetnames:
      raise ToolFailure("not_found", f"no sheet {sheet!r}; sheets: {', '.join(wb.sheetnames)}")
    v = _as_number(value)
    wb[sheet][cell.upper()] = v if v is not None else value
    wb.save(real)
    return f"{sheet}!{cell.upper()} = {wb[sheet][cell.upper()].value!r} in {self.rel(real)}"

  # ---- presentations -------------------------------------------------------------------------
  def presentations_read_presentation(self, path: str) -> str:
    """Read a slide deck (.pptx): every slide's title and text."""
    real = self.resolve(path)
    self._ext(real, (".pptx",), "presentations")

    def parse(p):
      from pptx import Presentation  # lazy: document library (see _workbook)
      out = []
      for i, s in enumerate(Presentation(p).slides):
        texts = [sh.text_frame.text for sh in s.shapes if sh.has_text_frame and sh.text_frame.text]
        out.append(f"--- slide {i + 1} ---\n" + "\n".join(texts))
      return "\n".join(out)
    return self._cached("pptx", real, parse)

  def presentations_add_slide(self, path: str, title: str, bullets: list[str]) -> str:
    """Append a title-and-bullets slide to a deck (.pptx)."""
    real = self.resolve(path)
    self._ext(real, (".pptx",), "presentations")
    from pptx import Presentation  # lazy: document library (see _workbook)
    prs = Presentation(real)
    s = prs.slides.add_slide(prs.slide_layouts[1])
    s.shapes.title.text = title
    tf = s.placeholders[1].text_frame
    tf.text = str(bullets[0]) if bullets else ""
    for b in bullets[1:]:
      tf.add_paragraph().text = str(b)
    prs.save(real)
    return f"added slide {len(prs.slides)} to {self.rel(real)}"

  # ---- mail ----------------------------------------------------------------------------------
  def mail_list_contacts(self) -> str:
    """List the people you can e-mail: name, role, address."""
    m = self._load("mail")
    return "\n".join(f"{p['name']}\t{p['role']}\t{p['email']}" for p in m["contacts"])

  def mail_list_messages(self, folder: str = "inbox", limit: int = 50) -> str:
    """List messages of a folder (inbox or sent), newest first: id, date, sender, subject."""
    m = self._load("mail")
    if folder not in ("inbox", "sent"):
      raise ToolFailure("bad_argument", "folder must be 'inbox' or 'sent'")
    msgs = [x for x in m["messages"] if x["folder"] == folder][::-1][:max(limit, 0)]
    return "\n".join(f"{x['id']}\t{x['date']}\t{x['sender']}\t{x['subject']}" for x in msgs) or "(no messages)"

  def mail_read_message(self, message_id: str) -> str:
    """Read one message in full by its id."""
    for x in self._load("mail")["messages"]:
      if x["id"] == message_id:
        return _fmt_mail(x)
    raise ToolFailure("not_found", f"no message {message_id!r}")

  def mail_search_messages(self, query: str) -> str:
    """Full messages whose subject, sender or body contains the text (case-insensitive)."""
    q = query.lower()
    hits = [_fmt_mail(x) for x in self._load("mail")["messages"]
            if q in (x["subject"] + " " + x["sender"] + " " + x["body"]).lower()]
    return "\n\n".join(hits) if hits else f"no message contains {query!r}"

  def mail_send_message(self, to: list[str], subject: str, body: str,
                        cc: list[str] | None = None) -> str:
    """Send an e-mail to one or more addresses (see mail_list_contacts)."""
    m = self._load("mail")
    rcpts = list(to) + list(cc or [])
    if not to:
      raise ToolFailure("bad_argument", "at least one recipient is needed")
    for a in rcpts:
      if not re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", str(a)):
        raise ToolFailure("bad_argument", f"not an e-mail address: {a!r}")
    n = sum(1 for x in m["messages"] if x["folder"] == "sent")
    msg = dict(id=f"s{n:03d}", folder="sent", sender=m["owner"], to=list(to), cc=list(cc or []),
               subject=subject, body=body, date=_today())
    m["messages"].append(msg)
    self._save("mail", m)
    return f"sent message {msg['id']} to {', '.join(rcpts)}"

  # ---- chat ----------------------------------------------------------------------------------
  def chat_list_channels(self) -> str:
    """List chat channels and how many messages each holds."""
    c = self._load("chat")
    return "\n".join(f"{k}\t{len(v)} messages" for k, v in sorted(c["channels"].items()))

  def chat_read_channel(self, channel: str, limit: int = 100) -> str:
    """Read the latest messages of a channel (e.g. '#general'), oldest first."""
    c = self._load("chat")
    ch = channel if channel.startswith("#") else "#" + channel
    if ch not in c["channels"]:
      raise ToolFailure("not_found", f"no channel {channel!r}; channels: {', '.join(sorted(c['channels']))}")
    msgs = c["channels"][ch][-max(limit, 1):]
    return "\n".join(f"[{x['date']}] {x['user']}: {x['text']}" for x in msgs) or "(no messages)"

  def chat_post_message(self, channel: str, text: str) -> str:
    """Post a message to a channel as yourself."""
    c = self._load("chat")
    ch = channel if channel.startswith("#") else "#" + channel
    if ch not in c["channels"]:
      raise ToolFailure("not_found", f"no channel {channel!r}")
    me = c["members"][0]["handle"]
    msg = dict(id=f"p{len(c['channels'][ch]):03d}", user=me, date=_today(), text=text, posted=True)
    c["channels"][ch].append(msg)
    self._save("chat", c)
    return f"posted to {ch}"

  # ---- calendar ------------------------------------------------------------------------------
  def calendar_list_events(self, start_date: str = "", end_date: str = "") -> str:
    """List calendar events, optionally between two ISO dates (inclusive)."""
    evs = self._load("calendar")["events"]
    for d in (start_date, end_date):
      if d:
        _parse_date(d)
    out = [e for e in evs if (not start_date or e["date"] >= start_date) and
           (not end_date or e["date"] <= end_date)]
    out.sort(key=lambda e: (e["date"], e["start"]))
    return "\n".join(f"{e['id']}\t{e['date']} {e['start']} ({e['duration_min']} min)\t{e['title']}\t"
                     f"attendees: {', '.join(e['attendees'])}" for e in out) or "(no events)"

  def calendar_create_event(self, title: str, date: str, start: str, duration_min: int,
                            attendees: list[str]) -> str:
    """Book a meeting: ISO date (YYYY-MM-DD), start time HH:MM, duration, attendee e-mails."""
    _parse_date(date)
    if not re.fullmatch(r"([01][0-9]|2[0-3]):[0-5][0-9]", start or ""):
      raise ToolFailure("bad_argument", f"start must be HH:MM, got {start!r}")
    if not 5 <= int(duration_min) <= 600:
      raise ToolFailure("bad_argument", "duration_min must be between 5 and 600")
    cal = self._load("calendar")
    ev = dict(id=f"new{len(cal['events']):03d}", title=title, date=date, start=start,
              duration_min=int(duration_min), attendees=sorted(set(attendees) | {cal["owner"]}))
    cal["events"].append(ev)
    self._save("calendar", cal)
    return f"booked {ev['id']}: {title} on {date} {start}"

  # ---- code execution ------------------------------------------------------------------------
  def code_execution_run_python(self, code: str) -> str:
    """Run Python 3 code in a sandbox whose working directory is the world's root folder.
    Print what you need to see; no network; time and memory are limited."""
    r = sandbox.run_python(code, self.files, self.cfg.sandbox, self.cfg.tool_output_chars,
                           cancel=self.cancel)
    return r.to_text()

  # ---- dispatch ------------------------------------------------------------------------------
  def call(self, name: str, args: dict) -> str:
    """Runs tool `name` in-process (the same path the MCP server takes), uncapped."""
    return dispatch(self, name, args)


def check_arguments(tools, name: str, args) -> None:
  """Raises ToolFailure `bad_argument` naming every argument of `args` that tool `name` of a
  tool set does not take (a misspelt or invented one is refused, never silently dropped)."""
  params = inspect.signature(getattr(tools, name)).parameters
  if any(p.kind == p.VAR_KEYWORD for p in params.values()):
    return
  unknown = [a for a in (args or {}) if a not in params]
  if unknown:
    raise ToolFailure("bad_argument", f"{name}: unknown argument{'s' if len(unknown) > 1 else ''} "
                      f"{', '.join(repr(a) for a in unknown)}; {name} takes "
                      f"{', '.join(params) or 'no arguments'}")


def dispatch(tools, name: str, args: dict) -> str:
  """Runs tool `name` of a tool set (its TOOL_NAMES, lock and cancel event) with `args`; every
  failure is a ToolFailure of the taxonomy."""
  if name not in tools.TOOL_NAMES:
    raise ToolFailure("unknown_tool", f"no tool {name!r}")
  check_arguments(tools, name, args)
  try:
    with tools.lock:
      tools.cancel.clear()
      return getattr(tools, name)(**(args or {}))
  except ToolFailure:
    raise
  except TypeError as e:
    raise ToolFailure("bad_argument", str(e)) from e
  except Exception as e:  # a bug, a malformed or unreadable file: still an error the agent sees
    raise ToolFailure("internal", f"{type(e).__name__}: {e}") from e


def cap_output(text: str, limit: int) -> str:
  if len(text) <= limit:
    return text
  return text[:limit] + f"\n...[truncated {len(text) - limit} characters]"


def _fmt_mail(x: dict) -> str:
  return (f"id: {x['id']}\ndate: {x['date']}\nfrom: {x['sender']}\nto: {', '.join(x['to'])}\n"
          f"subject: {x['subject']}\n\n{x['body']}")


def _today() -> str:
  # Worlds live in a fixed 2025; a constant "today" keeps app state reproducible.
  return "2025-12-01"


def _parse_date(d: str):
  try:
    return datetime.date.fromisoformat(d)
  except (TypeError, ValueError):
    raise ToolFailure("bad_argument", f"not an ISO date (YYYY-MM-DD): {d!r}") from None


def _as_number(s):
  if isinstance(s, (int, float)):
    return s
  t = str(s).strip().replace(",", "").replace("$", "")
  try:
    f = float(t)
  except ValueError:
    return None
  return int(f) if f.is_integer() and "." not in t else f
