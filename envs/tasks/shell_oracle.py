"""The oracle through the shell style: a task's MCP `oracle_steps` as shell-tool calls.

`shell_steps(task)` turns each app-tool call of the oracle into the one shell-tool call
(envs.apps.shell_tools: bash, read, write, edit, glob, grep) a capable agent would make for
it, keeping its `expect` facts; the final answer (`oracle_answer`) is the same. Documents are
read and written with python3 in bash (openpyxl, python-docx, python-pptx, pypdf), the apps'
JSON under apps/ with grep or python3, and an app action appends to that JSON exactly what the
app tool would have written (same id scheme, fields, date and JSON layout), so the grader sees
the same world state whichever style acted.

Paths: an MCP path "/x" is relative to the world's files/, a shell path to the world's folder,
so "/models/a.xlsx" becomes "files/models/a.xlsx".
"""
import re
import shlex

from envs.apps import tools as tools_lib


def shell_steps(task) -> list:
  """The task's oracle steps as shell-tool calls [{name, args, expect}], one per MCP step."""
  out = []
  for s in task.oracle_steps:
    name, args = translate(s["name"], dict(s["args"]))
    out.append(dict(name=name, args=args, expect=list(s.get("expect", []))))
  return out


def translate(name: str, args: dict) -> tuple:
  """One MCP tool call (name, args) as a shell-tool call (name, args)."""
  fn = _TRANSLATIONS.get(name)
  if fn is None:
    raise ValueError(f"no shell translation of the MCP tool {name!r}")
  return fn(**args)


def files_path(path: str) -> str:
  """An MCP path (relative to files/, '/' = its root) as a workspace path."""
  rel = path.strip().lstrip("/")
  return "files/" + rel if rel and rel != "." else "files"


def _bash(command: str) -> tuple:
  return "bash", {"command": command}


def _python(code: str, cwd: str = "") -> tuple:
  """bash running a python3 program given on a here-document."""
  end = "PY"
  while re.search(rf"^{end}$", code, re.M):
    end += "_END"
  head = f"cd {shlex.quote(cwd)} && " if cwd else ""
  return _bash(f"{head}python3 - <<'{end}'\n{code.rstrip()}\n{end}")


def _lines(*lines) -> str:
  return "\n".join(lines)


# ---- filesystem -------------------------------------------------------------------------------
def _list_directory(path: str = "/"):
  return _bash(f"ls -p {shlex.quote(files_path(path))}")


def _search_files(pattern: str, path: str = "/"):
  pat = pattern if any(c in pattern for c in "*?[") else f"*{pattern}*"
  return "glob", {"pattern": f"**/{pat}", "path": files_path(path)}


def _read_text_file(path: str):
  return "read", {"path": files_path(path)}


def _write_text_file(path: str, content: str):
  return "write", {"path": files_path(path), "content": content}


# ---- documents, pdfs, spreadsheets, presentations -----------------------------------------------
def _read_document(path: str):
  return _python(_lines(
      "import docx",
      f"doc = docx.Document({files_path(path)!r})",
      "for p in doc.paragraphs:",
      "    if p.text.strip():",
      "        print(p.text)",
      "for t in doc.tables:",
      "    for row in t.rows:",
      "        print(' | '.join(c.text for c in row.cells))"))


def _create_document(path: str, title: str, paragraphs: list):
  p = files_path(path)
  return _python(_lines(
      "import os, docx",
      "doc = docx.Document()",
      f"doc.add_heading({title!r}, level=1)",
      f"for text in {[str(x) for x in paragraphs]!r}:",
      "    doc.add_paragraph(text)",
      f"os.makedirs(os.path.dirname({p!r}), exist_ok=True)",
      f"doc.save({p!r})",
      f"print('created', {p!r})"))


def _read_pdf(path: str, first_page: int = 1, last_page: int = 0):
  stop = f"min({int(last_page)}, len(pages))" if last_page and last_page > 0 else "len(pages)"
  return _python(_lines(
      "import pypdf",
      f"pages = pypdf.PdfReader({files_path(path)!r}).pages",
      f"for i in range({int(first_page) - 1}, {stop}):",
      "    print(f'--- page {i + 1} of {len(pages)} ---')",
      "    print(pages[i].extract_text())"))


def _search_pdfs(query: str, path: str = "/"):
  return _python(_lines(
      "import glob, pypdf",
      f"for f in sorted(glob.glob('**/*.pdf', root_dir={files_path(path)!r}, recursive=True)):",
      f"    for i, page in enumerate(pypdf.PdfReader({files_path(path)!r} + '/' + f).pages, 1):",
      "        for line in (page.extract_text() or '').splitlines():",
      f"            if {query.lower()!r} in line.lower():",
      "                print(f'{f} p{i}: {line}')"))


def _list_sheets(path: str):
  return _python(_lines(
      "import openpyxl",
      f"for ws in openpyxl.load_workbook({files_path(path)!r}).worksheets:",
      "    print(ws.title, ws.dimensions)"))


def _read_sheet(path: str, sheet: str = "", max_rows: int = 200):
  del max_rows  # the sheets of a world are small: print them whole
  pick = f"[{sheet!r}]" if sheet else ".worksheets[0]"
  return _python(_lines(
      "import openpyxl",
      f"ws = openpyxl.load_workbook({files_path(path)!r}, data_only=True){pick}",
      "for row in ws.iter_rows(values_only=True):",
      "    print(row)"))


def _write_cell(path: str, sheet: str, cell: str, value):
  num = tools_lib._as_number(value)  # numbers are stored as numbers, as the app tool does
  p, ref = files_path(path), cell.upper()
  return _python(_lines(
      "import openpyxl",
      f"wb = openpyxl.load_workbook({p!r})",
      f"wb[{sheet!r}][{ref!r}] = {(num if num is not None else str(value))!r}",
      f"wb.save({p!r})",
      f"print({ref!r}, '=', wb[{sheet!r}][{ref!r}].value)"))


def _read_presentation(path: str):
  return _python(_lines(
      "from pptx import Presentation",
      f"for i, slide in enumerate(Presentation({files_path(path)!r}).slides, 1):",
      "    print(f'--- slide {i} ---')",
      "    for shape in slide.shapes:",
      "        if shape.has_text_frame and shape.text_frame.text:",
      "            print(shape.text_frame.text)"))


def _add_slide(path: str, title: str, bullets: list):
  p = files_path(path)
  bullets = [str(b) for b in bullets]
  return _python(_lines(
      "from pptx import Presentation",
      f"deck = Presentation({p!r})",
      "slide = deck.slides.add_slide(deck.slide_layouts[1])",
      f"slide.shapes.title.text = {title!r}",
      "body = slide.placeholders[1].text_frame",
      f"bullets = {bullets!r}",
      "body.text = bullets[0] if bullets else ''",
      "for b in bullets[1:]:",
      "    body.add_paragraph().text = b",
      f"deck.save({p!r})",
      "print('slides:', len(deck.slides))"))


# ---- mail, chat, calendar (apps/*.json) ---------------------------------------------------------
_LOAD = "import json\nwith open({f!r}) as f:\n    {v} = json.load(f)"
# The app tools' layout of the JSON (WorldTools._save), so a file is written the same either way.
_SAVE = _lines("with open({f!r}, 'w') as f:", "    json.dump({v}, f, indent=1, sort_keys=True)",
               "    f.write('\\n')")


def _load(app: str, var: str) -> str:
  return _LOAD.format(f=f"apps/{app}.json", v=var)


def _save(app: str, var: str) -> str:
  return _SAVE.format(f=f"apps/{app}.json", v=var)


def _list_contacts():
  return "grep", {"pattern": '"(name|role|email)":', "path": "apps/mail.json"}


def _list_messages(folder: str = "inbox", limit: int = 50):
  return _python(_lines(
      _load("mail", "mail"),
      f"msgs = [m for m in mail['messages'] if m['folder'] == {folder!r}][::-1][:{int(limit)}]",
      "for m in msgs:",
      "    print(m['id'], m['date'], m['sender'], m['subject'], sep='\\t')"))


def _read_message(message_id: str):
  return _python(_lines(
      _load("mail", "mail"),
      "for m in mail['messages']:",
      f"    if m['id'] == {message_id!r}:",
      "        print(json.dumps(m, indent=1))"))


def _search_messages(query: str):
  return "grep", {"pattern": "(?i)" + re.escape(query), "path": "apps/mail.json"}


def _send_message(to: list, subject: str, body: str, cc: list = None):
  return _python(_lines(
      _load("mail", "mail"),
      "n = sum(1 for m in mail['messages'] if m['folder'] == 'sent')",
      "msg = {'id': f's{n:03d}', 'folder': 'sent', 'sender': mail['owner'],",
      f"       'to': {list(to)!r}, 'cc': {list(cc or [])!r}, 'subject': {subject!r},",
      f"       'body': {body!r}, 'date': {tools_lib._today()!r}}}",
      "mail['messages'].append(msg)",
      _save("mail", "mail"),
      "print('sent', msg['id'])"))


def _channel(channel: str) -> str:
  return channel if channel.startswith("#") else "#" + channel


def _list_channels():
  return _python(_lines(
      _load("chat", "chat"),
      "for name, msgs in sorted(chat['channels'].items()):",
      "    print(name, len(msgs), 'messages')"))


def _read_channel(channel: str, limit: int = 100):
  return _python(_lines(
      _load("chat", "chat"),
      f"for m in chat['channels'][{_channel(channel)!r}][-{max(int(limit), 1)}:]:",
      "    print(f\"[{m['date']}] {m['user']}: {m['text']}\")"))


def _post_message(channel: str, text: str):
  ch = _channel(channel)
  return _python(_lines(
      _load("chat", "chat"),
      f"msgs = chat['channels'][{ch!r}]",
      "msgs.append({'id': f'p{len(msgs):03d}', 'user': chat['members'][0]['handle'],",
      f"             'date': {tools_lib._today()!r}, 'text': {text!r}, 'posted': True}})",
      _save("chat", "chat"),
      f"print('posted to', {ch!r})"))


def _list_events(start_date: str = "", end_date: str = ""):
  return _python(_lines(
      _load("calendar", "cal"),
      f"events = [e for e in cal['events'] if {start_date!r} <= e['date'] and "
      f"(not {end_date!r} or e['date'] <= {end_date!r})]",
      "for e in sorted(events, key=lambda e: (e['date'], e['start'])):",
      "    print(e['id'], e['date'], e['start'], e['duration_min'], e['title'],",
      "          ', '.join(e['attendees']), sep='\\t')"))


def _create_event(title: str, date: str, start: str, duration_min: int, attendees: list):
  return _python(_lines(
      _load("calendar", "cal"),
      f"cal['events'].append({{'id': f\"new{{len(cal['events']):03d}}\", 'title': {title!r},",
      f"                      'date': {date!r}, 'start': {start!r}, "
      f"'duration_min': {int(duration_min)!r},",
      f"                      'attendees': sorted(set({list(attendees)!r}) | {{cal['owner']}})}})",
      _save("calendar", "cal"),
      "print('booked', cal['events'][-1]['id'])"))


# ---- code execution ---------------------------------------------------------------------------
def _run_python(code: str):
  # The app's sandbox runs code in files/; so does this.
  return _python(code, cwd="files")


_TRANSLATIONS = {
    "filesystem_list_directory": _list_directory,
    "filesystem_search_files": _search_files,
    "filesystem_read_text_file": _read_text_file,
    "filesystem_write_text_file": _write_text_file,
    "documents_read_document": _read_document,
    "documents_create_document": _create_document,
    "pdfs_read_pdf": _read_pdf,
    "pdfs_search_pdfs": _search_pdfs,
    "spreadsheets_list_sheets": _list_sheets,
    "spreadsheets_read_sheet": _read_sheet,
    "spreadsheets_write_cell": _write_cell,
    "presentations_read_presentation": _read_presentation,
    "presentations_add_slide": _add_slide,
    "mail_list_contacts": _list_contacts,
    "mail_list_messages": _list_messages,
    "mail_read_message": _read_message,
    "mail_search_messages": _search_messages,
    "mail_send_message": _send_message,
    "chat_list_channels": _list_channels,
    "chat_read_channel": _read_channel,
    "chat_post_message": _post_message,
    "calendar_list_events": _list_events,
    "calendar_create_event": _create_event,
    "code_execution_run_python": _run_python,
}
