"""The shell style of a world's tools (config.harness.style = "shell"): an OpenCode-like tool set
over the world's folder instead of the app tools of `envs.apps.tools`.

`ShellTools(world_dir, envs_cfg)` has the interface of `WorldTools` (TOOL_NAMES, `call`, a lock,
a cancel event), so the MCP gateway serves either set the same way: schemas from the type
hints below, the server-side time limit, the output cap, failures as `ToolFailure` kinds.

  bash   a command (/bin/sh) run by `envs.sandbox.run_shell` on a copy of the workspace that is
         copied back when it ends (a run stopped by its time limit leaves the world as it was)
  read   a text file, with line numbers; optional line range (offset, limit)
  write  create or overwrite a file
  edit   replace an exact string of a file (unique, or every occurrence with replace_all)
  glob   paths matching a pattern ('**' spans folders)
  grep   lines matching a regular expression, in a file or under a folder (include: a
         file-name filter)

The workspace is the whole world directory: `files/` (documents as they are; a path "/x" of a
task is "files/x") and `apps/` (mail.json, chat.json, calendar.json: the apps' state, re-read
by the grader). An app action of the MCP style is an edit of those files here: sending an
e-mail appends a message with folder "sent" to apps/mail.json, as `WorldTools.mail_send_message`
does. Paths are relative to the workspace root ("/workspace/..." , where bash sees it, is
accepted too); anything that resolves outside it is `path_outside_world`.
"""
import fnmatch
import glob as glob_lib
import os
import re
import threading

from envs import sandbox
from envs.apps import tools as tools_lib
from envs.apps.tools import ToolFailure

STYLES = ("mcp", "shell")
WORKSPACE = "/workspace"  # where bash sees the workspace
READ_LIMIT = 2000         # lines `read` returns by default
LINE_CHARS = 2000         # longer lines are cut in `read`
GREP_LINE_CHARS = 400     # longer matching lines are cut in `grep`
MAX_MATCHES = 200         # `grep` matches and `glob` paths listed
# Formats that are zip or PDF containers: read them with python3 in bash.
BINARY_EXT = (".xlsx", ".docx", ".pptx", ".pdf", ".zip", ".png", ".jpg", ".jpeg", ".gif")

SYSTEM_PROMPT = (
    "Your workspace (the working directory of bash; tool paths are relative to it) is a copy "
    "of your work world. files/ holds the documents: a path such as /models/x.xlsx in a "
    "request is files/models/x.xlsx. apps/ holds the apps' state as JSON: apps/mail.json "
    "(contacts; messages, folder inbox or sent), apps/chat.json (channels), "
    "apps/calendar.json (events). To send an e-mail, post in a channel or book a meeting, "
    "append an entry with a new id to that file in the format of the existing ones. python3 "
    "in bash has openpyxl, python-docx, python-pptx and pypdf.")


def check_style(style: str) -> str:
  """The style, or a ValueError naming the config key."""
  if style not in STYLES:
    raise ValueError(f"config.harness.style={style!r}; expected one of {' | '.join(STYLES)}")
  return style


def tool_names(style: str) -> tuple:
  """The tools a world of this style serves."""
  return ShellTools.TOOL_NAMES if check_style(style) == "shell" else tools_lib.WorldTools.TOOL_NAMES


def toolset(style: str):
  """The tool class of a style: WorldTools (mcp) or ShellTools (shell)."""
  return ShellTools if check_style(style) == "shell" else tools_lib.WorldTools


class ShellTools:
  """Shell tools of one world. Thread-safe: calls are serialised by a lock."""

  TOOL_NAMES = ("bash", "read", "write", "edit", "glob", "grep")

  def __init__(self, world_dir: str, envs_cfg):
    self.world_dir = os.path.realpath(world_dir)
    self.root = self.world_dir
    self.cfg = envs_cfg
    self.lock = threading.RLock()
    # Set by the server when a call outlives its time limit: stops a running command.
    self.cancel = threading.Event()

  # ---- helpers -------------------------------------------------------------------------------
  def resolve(self, path: str, must_exist: bool = True) -> str:
    """Maps a workspace path ("files/x.txt", "/workspace/files/x.txt") to a real path in it."""
    if not isinstance(path, str) or "\x00" in path:
      raise ToolFailure("bad_argument", "path must be a string")
    rel = path.strip() or "."
    if rel == WORKSPACE or rel.startswith(WORKSPACE + "/"):
      rel = rel[len(WORKSPACE):].lstrip("/") or "."
    elif os.path.isabs(rel):
      raise ToolFailure("path_outside_world",
                        f"{path!r} is outside the workspace; paths are relative to its root "
                        "(e.g. files/..., apps/mail.json)")
    real = os.path.realpath(os.path.join(self.root, rel))
    if real != self.root and not real.startswith(self.root + os.sep):
      raise ToolFailure("path_outside_world", f"{path!r} resolves outside the workspace")
    if must_exist and not os.path.exists(real):
      raise ToolFailure("not_found", f"no such file or directory: {path!r}")
    return real

  def rel(self, real: str) -> str:
    rel = os.path.relpath(real, self.root).replace(os.sep, "/")
    return "." if rel == "." else rel

  def _text_file(self, path: str) -> str:
    """The real path of an existing text file (errors name what to do instead)."""
    real = self.resolve(path)
    if os.path.isdir(real):
      raise ToolFailure("bad_argument", f"{path!r} is a folder; list it with glob or bash ls")
    if _is_binary(real):
      raise ToolFailure("unsupported",
                        f"{path!r} is not a text file; read it with python3 in bash (openpyxl, "
                        "python-docx, python-pptx, pypdf)")
    return real

  # ---- tools ---------------------------------------------------------------------------------
  def bash(self, command: str) -> str:
    """Run a shell command (/bin/sh) in a sandbox whose working directory is the workspace: the
    world's folder, with files/ (documents: .xlsx, .docx, .pptx, .pdf, text) and apps/
    (mail.json, chat.json, calendar.json: the mail, chat and calendar apps' state). python3
    has openpyxl, python-docx, python-pptx and pypdf. No network; time and memory are
    limited; what the command changes in the workspace is kept."""
    if not isinstance(command, str) or not command.strip():
      raise ToolFailure("bad_argument", "command is empty")
    r = sandbox.run_shell(command, self.root, self.cfg.sandbox, int(self.cfg.tool_output_chars),
                          cancel=self.cancel)
    if r.status in ("timeout", "cancelled"):
      raise ToolFailure("timeout", f"the command was stopped after {r.wall_s:.1f}s (limit "
                        f"{float(self.cfg.sandbox.wall_s):g}s); the workspace is unchanged\n"
                        + r.to_text())
    if r.status == "refused":
      raise ToolFailure("unsupported", r.stderr)
    return r.to_text()

  def read(self, path: str, offset: int = 1, limit: int = READ_LIMIT) -> str:
    """Read a text file with line numbers; offset = first line (1-based), limit = lines."""
    real = self._text_file(path)
    if not isinstance(offset, int) or not isinstance(limit, int) or offset < 1 or limit < 1:
      raise ToolFailure("bad_argument", f"offset and limit must be integers >= 1, got "
                        f"{offset!r}, {limit!r}")
    with open(real, encoding="utf-8", errors="replace", newline="") as f:
      lines = f.read().splitlines()
    if not lines:
      return f"{self.rel(real)}: (empty file)"
    if offset > len(lines):
      raise ToolFailure("bad_argument", f"offset {offset} is past the end of {self.rel(real)} "
                        f"({len(lines)} lines)")
    last = min(len(lines), offset + limit - 1)
    out = [f"{i}\t{_cut(lines[i - 1], LINE_CHARS)}" for i in range(offset, last + 1)]
    if offset > 1 or last < len(lines):
      out.append(f"(lines {offset}-{last} of {len(lines)}; use offset and limit for the rest)")
    return "\n".join(out)

  def write(self, path: str, content: str) -> str:
    """Create or overwrite a file with the given content; parent folders are created."""
    real = self.resolve(path, must_exist=False)
    if os.path.isdir(real):
      raise ToolFailure("bad_argument", f"{path!r} is a folder")
    if not isinstance(content, str):
      raise ToolFailure("bad_argument", "content must be a string")
    os.makedirs(os.path.dirname(real), exist_ok=True)
    _write_text(real, content)
    return f"wrote {len(content)} characters to {self.rel(real)}"

  def edit(self, path: str, old_string: str, new_string: str, replace_all: bool = False) -> str:
    """Replace old_string with new_string in a text file. old_string must match exactly
    (whitespace included) and occur once, unless replace_all replaces every occurrence."""
    real = self._text_file(path)
    if not isinstance(old_string, str) or not isinstance(new_string, str) or not old_string:
      raise ToolFailure("bad_argument", "old_string must be a non-empty string, new_string a "
                        "string")
    if old_string == new_string:
      raise ToolFailure("bad_argument", "old_string and new_string are the same")
    with open(real, encoding="utf-8", errors="replace", newline="") as f:
      text = f.read()
    n = text.count(old_string)
    if n == 0:
      raise ToolFailure("not_found", f"old_string not found in {self.rel(real)}")
    if n > 1 and not replace_all:
      raise ToolFailure("bad_argument", f"old_string occurs {n} times in {self.rel(real)}; add "
                        "surrounding text to make it unique, or set replace_all")
    _write_text(real, text.replace(old_string, new_string))
    return f"replaced {n if replace_all else 1} occurrence(s) in {self.rel(real)}"

  def glob(self, pattern: str, path: str = ".") -> str:
    """Paths under a folder (default the workspace root) matching a glob pattern, e.g.
    'files/**/*.xlsx' ('**' spans folders); folders end in '/'."""
    base = self.resolve(path)
    if not os.path.isdir(base):
      raise ToolFailure("bad_argument", f"not a folder: {path!r}")
    if not isinstance(pattern, str) or not pattern.strip():
      raise ToolFailure("bad_argument", "pattern is empty")
    if os.path.isabs(pattern) or ".." in pattern.split("/"):
      raise ToolFailure("path_outside_world", f"pattern {pattern!r} reaches outside the folder; "
                        "give a relative pattern and the folder as path")
    hits = []
    for m in sorted(glob_lib.glob(pattern, root_dir=base, recursive=True)):
      real = os.path.realpath(os.path.join(base, m))
      if real == self.root or real.startswith(self.root + os.sep):
        name = self.rel(os.path.join(base, m))
        hits.append(name + "/" if os.path.isdir(real) else name)
    if not hits:
      return f"no paths match {pattern!r} under {self.rel(base)}"
    more = len(hits) - MAX_MATCHES
    tail = [f"({more} more paths not shown)"] if more > 0 else []
    return "\n".join(hits[:MAX_MATCHES] + tail)

  def grep(self, pattern: str, path: str = ".", include: str = "") -> str:
    """Lines matching a regular expression (Python syntax; '(?i)' ignores case) in a file or in
    the text files under a folder, as 'path:line: text'; include filters file names (e.g.
    '*.json')."""
    try:
      rx = re.compile(pattern)
    except (re.error, TypeError) as e:
      raise ToolFailure("bad_argument", f"not a regular expression: {pattern!r} ({e})") from None
    real = self.resolve(path)
    hits = []
    for f in self._grep_files(real, include):
      with open(f, encoding="utf-8", errors="replace", newline="") as fh:
        for i, line in enumerate(fh.read().splitlines(), 1):
          if rx.search(line):
            hits.append(f"{self.rel(f)}:{i}: {_cut(line, GREP_LINE_CHARS)}")
    if not hits:
      return f"no line matches {pattern!r} under {self.rel(real)}"
    more = len(hits) - MAX_MATCHES
    tail = [f"({more} more matches not shown)"] if more > 0 else []
    return "\n".join(hits[:MAX_MATCHES] + tail)

  def _grep_files(self, real: str, include: str) -> list:
    if os.path.isfile(real):
      return [] if _is_binary(real) else [real]
    out = []
    for d, dirs, names in os.walk(real):
      dirs.sort()
      for n in sorted(names):
        f = os.path.join(d, n)
        if include and not fnmatch.fnmatch(n, include):
          continue
        inside = os.path.realpath(f).startswith(self.root + os.sep)
        if inside and os.path.isfile(f) and not _is_binary(f):
          out.append(f)
    return out

  # ---- dispatch ------------------------------------------------------------------------------
  def call(self, name: str, args: dict) -> str:
    """Runs tool `name` in-process (the path the MCP server takes), uncapped."""
    return tools_lib.dispatch(self, name, args)


def _cut(line: str, n: int) -> str:
  return line if len(line) <= n else line[:n] + f"...[{len(line) - n} more characters]"


def _is_binary(real: str) -> bool:
  if real.lower().endswith(BINARY_EXT):
    return True
  with open(real, "rb") as f:
    return b"\x00" in f.read(8192)


def _write_text(real: str, content: str):
  tmp = real + ".tmp-write"
  with open(tmp, "w", encoding="utf-8", newline="") as f:
    f.write(content)
  os.replace(tmp, real)
