"""The shell tool style (envs/apps/shell_tools.py): bash, read, write, edit, glob, grep over a
world's folder; their failures as the taxonomy's kinds; the gateway serving them; app actions
written as files exactly as the app tools write them; the style's config key."""
import json
import os
import shutil
import time

import docx
import openpyxl
import pptx
import pytest

from configs import base
from envs import tasks as tasks_lib
from envs import worlds
from envs.apps import gateway as gateway_lib
from envs.apps import shell_tools
from envs.apps import tools as tools_lib
from envs.apps.tools import ToolFailure
from envs.harness import tool_subset
from envs.harness.episodes import task_episodes
from envs.tasks import rubric
from envs.tasks import shell_oracle
from envs.worlds import render

SHELL = ("bash", "read", "write", "edit", "glob", "grep")


@pytest.fixture
def cfg():
  c = base.get_config().envs
  c.sandbox.wall_s = 5.0
  return c


@pytest.fixture
def world(tmp_path):
  """A small world folder: files/ with text, a binary file and a nested folder; apps/."""
  w = tmp_path / "world"
  (w / "files" / "notes").mkdir(parents=True)
  (w / "apps").mkdir()
  (w / "files" / "notes" / "a.txt").write_text("alpha\nbeta\ngamma\nbeta again\n")
  (w / "files" / "notes" / "b.md").write_text("# Title\nDelta Industries: 42\n")
  (w / "files" / "data.bin").write_bytes(b"\x00\x01\x02beta")
  (w / "apps" / "mail.json").write_text(json.dumps({"owner": "me@x.com", "messages": []}))
  return str(w)


@pytest.fixture
def tools(world, cfg):
  return shell_tools.ShellTools(world, cfg)


def _kind(tools, name, args):
  with pytest.raises(ToolFailure) as e:
    tools.call(name, args)
  return e.value.kind


# ---- bash ------------------------------------------------------------------------------------
def test_bash_runs_in_the_workspace_and_keeps_what_it_writes(tools, world):
  out = tools.call("bash", {"command": "cat files/notes/a.txt && pwd && echo made > files/new.txt"})
  assert out.startswith("status: ok") and "gamma" in out
  with open(os.path.join(world, "files", "new.txt")) as f:
    assert f.read() == "made\n"


def test_bash_reads_documents_with_python3(tools, world):
  wb = openpyxl.Workbook()
  wb.active.title = "Model"
  wb.active["B2"] = 123.5
  wb.save(os.path.join(world, "files", "m.xlsx"))
  code = "import openpyxl; print(openpyxl.load_workbook('files/m.xlsx')['Model']['B2'].value)"
  out = tools.call("bash", {"command": f'python3 -c "{code}"'})
  assert "123.5" in out


def test_bash_nonzero_exit_is_output_not_a_failure(tools):
  out = tools.call("bash", {"command": "echo oops >&2; exit 3"})
  assert out.startswith("status: error (exit code 3") and "oops" in out


def test_bash_command_timeout_is_a_timeout_failure_and_leaves_the_world_unchanged(tools, world):
  tools.cfg.sandbox.wall_s = 1.0
  with pytest.raises(ToolFailure) as e:
    tools.call("bash", {"command": "echo x > files/late.txt; sleep 30"})
  assert e.value.kind == "timeout" and "stopped" in str(e.value)
  assert not os.path.exists(os.path.join(world, "files", "late.txt"))


def test_bash_empty_command_is_a_bad_argument(tools):
  assert _kind(tools, "bash", {"command": "  "}) == "bad_argument"


def test_long_output_is_cut_at_tool_output_chars(world, cfg):
  cfg.tool_output_chars = 500
  gw = gateway_lib.LocalGateway(world, cfg, "shell")
  r = gw.call_tool("bash", {"command": "python3 -c \"print('x' * 5000)\""})
  assert not r.is_error and "...[truncated" in r.text and len(r.text) < 560
  with open(os.path.join(world, "files", "long.txt"), "w") as f:
    f.write("\n".join(f"line {i}" for i in range(400)))
  r = gw.call_tool("read", {"path": "files/long.txt"})
  assert "...[truncated" in r.text and len(r.text) < 560


# ---- read ------------------------------------------------------------------------------------
def test_read_numbers_lines_and_takes_a_range(tools):
  assert tools.call("read", {"path": "files/notes/a.txt"}) == (
      "1\talpha\n2\tbeta\n3\tgamma\n4\tbeta again")
  out = tools.call("read", {"path": "files/notes/a.txt", "offset": 2, "limit": 2})
  assert out.startswith("2\tbeta\n3\tgamma\n") and "lines 2-3 of 4" in out


def test_read_failures(tools):
  assert _kind(tools, "read", {"path": "files/missing.txt"}) == "not_found"
  assert _kind(tools, "read", {"path": "files/data.bin"}) == "unsupported"
  assert _kind(tools, "read", {"path": "files/notes"}) == "bad_argument"
  assert _kind(tools, "read", {"path": "files/notes/a.txt", "offset": 9}) == "bad_argument"
  assert _kind(tools, "read", {"path": "files/notes/a.txt", "limit": 0}) == "bad_argument"
  assert _kind(tools, "read", {}) == "bad_argument"  # a required argument missing


def test_workspace_prefix_names_the_same_file(tools):
  assert tools.call("read", {"path": "/workspace/files/notes/b.md"}) == (
      tools.call("read", {"path": "files/notes/b.md"}))


# ---- write, edit -----------------------------------------------------------------------------
def test_write_creates_parent_folders_and_overwrites(tools, world):
  out = tools.call("write", {"path": "files/out/x/r.txt", "content": "hello"})
  assert out == "wrote 5 characters to files/out/x/r.txt"
  tools.call("write", {"path": "files/out/x/r.txt", "content": "bye\n"})
  with open(os.path.join(world, "files", "out", "x", "r.txt")) as f:
    assert f.read() == "bye\n"
  assert _kind(tools, "write", {"path": "files/notes", "content": "x"}) == "bad_argument"


def test_edit_replaces_an_exact_unique_string(tools, world):
  tools.call("edit", {"path": "files/notes/a.txt", "old_string": "gamma\n", "new_string": "G\n"})
  with open(os.path.join(world, "files", "notes", "a.txt")) as f:
    assert f.read() == "alpha\nbeta\nG\nbeta again\n"


def test_edit_fails_when_the_string_is_missing_or_not_unique(tools, world):
  path = os.path.join(world, "files", "notes", "a.txt")
  before = open(path).read()
  assert _kind(tools, "edit", {"path": "files/notes/a.txt", "old_string": "zeta",
                               "new_string": "z"}) == "not_found"
  with pytest.raises(ToolFailure, match="occurs 2 times") as e:
    tools.call("edit", {"path": "files/notes/a.txt", "old_string": "beta", "new_string": "B"})
  assert e.value.kind == "bad_argument"
  assert open(path).read() == before
  assert _kind(tools, "edit", {"path": "files/missing.txt", "old_string": "a",
                               "new_string": "b"}) == "not_found"
  assert _kind(tools, "edit", {"path": "files/notes/a.txt", "old_string": "",
                               "new_string": "b"}) == "bad_argument"
  out = tools.call("edit", {"path": "files/notes/a.txt", "old_string": "beta", "new_string": "B",
                            "replace_all": True})
  assert "replaced 2" in out and open(path).read() == "alpha\nB\ngamma\nB again\n"


# ---- glob, grep ------------------------------------------------------------------------------
def test_glob_matches_across_folders_and_marks_folders(tools):
  assert tools.call("glob", {"pattern": "**/*.txt"}).splitlines() == ["files/notes/a.txt"]
  assert tools.call("glob", {"pattern": "*", "path": "files"}).splitlines() == [
      "files/data.bin", "files/notes/"]
  assert tools.call("glob", {"pattern": "**/*.xlsx"}).startswith("no paths match")
  assert _kind(tools, "glob", {"pattern": "*", "path": "files/nowhere"}) == "not_found"


def test_grep_gives_path_and_line_of_each_match(tools):
  out = tools.call("grep", {"pattern": "beta"})
  assert out.splitlines() == ["files/notes/a.txt:2: beta", "files/notes/a.txt:4: beta again"]
  assert tools.call("grep", {"pattern": "(?i)delta", "path": "files", "include": "*.md"}) == (
      "files/notes/b.md:2: Delta Industries: 42")
  assert tools.call("grep", {"pattern": "beta", "include": "*.md"}).startswith("no line matches")
  assert _kind(tools, "grep", {"pattern": "(unclosed"}) == "bad_argument"
  assert _kind(tools, "grep", {"pattern": "x", "path": "files/missing"}) == "not_found"


# ---- paths outside the workspace -------------------------------------------------------------
OUTSIDE = [("read", {"path": "../secret.txt"}),
           ("read", {"path": "/etc/passwd"}),
           ("read", {"path": "files/../../secret.txt"}),
           ("read", {"path": "files/link_out"}),
           ("write", {"path": "../secret.txt", "content": "x"}),
           ("write", {"path": "/tmp/shell_tools_escape.txt", "content": "x"}),
           ("edit", {"path": "files/link_out", "old_string": "s", "new_string": "t"}),
           ("glob", {"pattern": "../*"}),
           ("glob", {"pattern": "*", "path": "/etc"}),
           ("grep", {"pattern": "s", "path": "files/link_out"}),
           ("grep", {"pattern": "s", "path": "/etc"})]


@pytest.mark.parametrize("name,args", OUTSIDE,
                         ids=[f"{n}:{list(a.values())[0]}" for n, a in OUTSIDE])
def test_paths_outside_the_workspace_are_refused(tools, world, name, args):
  secret = os.path.join(os.path.dirname(world), "secret.txt")
  with open(secret, "w") as f:
    f.write("secret\n")
  os.symlink(secret, os.path.join(world, "files", "link_out"))
  assert _kind(tools, name, args) == "path_outside_world"
  assert open(secret).read() == "secret\n"
  assert not os.path.exists("/tmp/shell_tools_escape.txt")


def test_grep_over_a_folder_skips_links_out_of_it(tools, world):
  secret = os.path.join(os.path.dirname(world), "secret.txt")
  with open(secret, "w") as f:
    f.write("secret\n")
  os.symlink(secret, os.path.join(world, "files", "link_out"))
  assert tools.call("grep", {"pattern": "secret"}).startswith("no line matches")


def test_unknown_tool_is_refused(tools):
  assert _kind(tools, "filesystem_read_text_file", {"path": "notes/a.txt"}) == "unknown_tool"


# ---- served like the app tools ---------------------------------------------------------------
def test_gateway_serves_the_shell_tools_with_typed_schemas(world, cfg):
  local = gateway_lib.LocalGateway(world, cfg, "shell")
  specs = {t["name"]: t for t in local.list_tools()}
  assert tuple(specs) == SHELL
  assert specs["read"]["input_schema"]["properties"]["offset"]["type"] == "integer"
  assert specs["edit"]["input_schema"]["required"] == ["path", "old_string", "new_string"]
  with gateway_lib.Gateway(world, cfg, "shell") as gw:
    assert [t["name"] for t in gw.list_tools()] == list(SHELL)
    r = gw.call_tool("read", {"path": "files/notes/b.md"}, timeout=30)
    assert not r.is_error and "Delta Industries" in r.text
    r = gw.call_tool("read", {"path": "files/none.txt"}, timeout=30)
    assert r.is_error and r.error_kind == "not_found"
    r = gw.call_tool("read", {"path": "/etc/passwd"}, timeout=30)
    assert r.is_error and r.error_kind == "path_outside_world"


def test_server_time_limit_stops_a_long_command(world, cfg):
  cfg.tool_time_limit_s = 1.0
  cfg.sandbox.wall_s = 30.0
  with gateway_lib.Gateway(world, cfg, "shell") as gw:
    t0 = time.monotonic()
    r = gw.call_tool("bash", {"command": "sleep 20"}, timeout=30)
    assert r.is_error and r.error_kind == "timeout" and time.monotonic() - t0 < 10
    # The stopped run takes the sandbox ~2 s to reap (envs.sandbox._kill_session waits on its
    # own zombie); a call meanwhile would wait for the tool lock and time out too.
    time.sleep(3)
    r = gw.call_tool("bash", {"command": "echo again"}, timeout=30)  # the gateway still serves
    assert not r.is_error and "again" in r.text


def test_bad_style_raises_an_error_naming_the_config_key(world, cfg):
  with pytest.raises(ValueError, match=r"config\.harness\.style='zsh'"):
    shell_tools.check_style("zsh")
  with pytest.raises(ValueError, match=r"config\.harness\.style"):
    gateway_lib.LocalGateway(world, cfg, "zsh")
  c = base.get_config()
  c.harness.style = "bash"
  task = tasks_lib.load_split(c.envs, "eval")[0]
  with pytest.raises(ValueError, match=r"config\.harness\.style='bash'"):
    task_episodes([task], c)


class _StyledWorld:
  def __init__(self, style, names):
    self.style, self._names = style, names

  def tools(self):
    return [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
        for n in self._names]


@pytest.mark.parametrize("names,shown", [
    (("spreadsheets_read_sheet", "pdfs_read_pdf"), SHELL),   # app-tool names: not this style's
    (("read", "grep"), ("read", "grep")),
    ((), SHELL)])
def test_tool_subset_follows_the_style(names, shown):
  w = tool_subset.ToolSubsetWorld(_StyledWorld("shell", SHELL), names, "compact")
  assert tuple(t["function"]["name"] for t in w.tools()) == shown
  mcp = tool_subset.ToolSubsetWorld(_StyledWorld("mcp", tools_lib.WorldTools.TOOL_NAMES),
                                    ("bash", "pdfs_read_pdf"))
  assert [t["function"]["name"] for t in mcp.tools()] == ["pdfs_read_pdf"]
  with pytest.raises(ValueError, match="zzz"):
    tool_subset.ToolSubsetWorld(_StyledWorld("shell", SHELL), ("read", "zzz")).tools()


# ---- app actions as files, graded the same ---------------------------------------------------
@pytest.fixture(scope="module")
def real_world(tmp_path_factory):
  c = base.get_config().envs
  spec = worlds.all_specs(c)["co00"]
  d = worlds.world_dir(str(tmp_path_factory.mktemp("worlds")), "co00")
  worlds.generate_world(c, spec, d)
  return c, spec, d


def _actions(spec):
  people = [p["email"] for p in spec["people"][1:3]]
  deck = "/" + render.deck_path(spec)
  channel = next(iter(e["chat_fact"]["channel"] for e in spec["entities"]))
  return [
      ("mail_send_message", {"to": people[:1], "cc": people[1:], "subject": "Q3 - figures",
                             "body": "Hi,\n\nThe figure is 12.5 ($m, \"net\").\n\nBest"}),
      ("chat_post_message", {"channel": channel.lstrip("#"), "text": "Revenue FY2024: 1,234.5"}),
      ("calendar_create_event", {"title": "Prep 'A' & B", "date": "2025-10-02", "start": "09:30",
                                 "duration_min": 45, "attendees": people}),
      ("spreadsheets_write_cell", {"path": "/" + render.SUMMARY_PATH,
                                   "sheet": render.SUMMARY_SHEET, "cell": "b3", "value": "-4.2"}),
      ("spreadsheets_write_cell", {"path": "/" + render.SUMMARY_PATH,
                                   "sheet": render.SUMMARY_SHEET, "cell": "C4", "value": "n/a"}),
      ("presentations_add_slide", {"path": deck, "title": "Update", "bullets": ["a: 1", "b: 2"]}),
      ("documents_create_document", {"path": "/outputs/memo.docx", "title": "Memo",
                                     "paragraphs": ["First.", "Second: 3.5"]}),
      ("filesystem_write_text_file", {"path": "/outputs/avg.txt", "content": "17.25\n"}),
  ]


def _text(root, rel):
  with open(os.path.join(root, rel)) as f:
    return f.read()


def _slides(path):
  return [[sh.text_frame.text for sh in s.shapes if sh.has_text_frame]
          for s in pptx.Presentation(path).slides]


def test_shell_actions_write_what_the_app_tools_write(real_world, tmp_path):
  envs_cfg, spec, pristine = real_world
  a, b = str(tmp_path / "mcp"), str(tmp_path / "shell")
  shutil.copytree(pristine, a)
  shutil.copytree(pristine, b)
  app, sh = tools_lib.WorldTools(a, envs_cfg), shell_tools.ShellTools(b, envs_cfg)
  for name, args in _actions(spec):
    app.call(name, args)
    tname, targs = shell_oracle.translate(name, args)
    out = sh.call(tname, targs)
    assert tname != "bash" or out.startswith("status: ok"), (name, out)
  for f in ("apps/mail.json", "apps/chat.json", "apps/calendar.json", "files/outputs/avg.txt"):
    assert _text(a, f) == _text(b, f), f  # byte for byte: same ids, fields, date, layout
  summary = lambda root: [[c.value for c in row] for row in openpyxl.load_workbook(  # noqa: E731
      os.path.join(root, "files", render.SUMMARY_PATH))[render.SUMMARY_SHEET].iter_rows()]
  assert summary(a) == summary(b)
  assert openpyxl.load_workbook(os.path.join(b, "files", render.SUMMARY_PATH))[
      render.SUMMARY_SHEET]["B3"].value == -4.2
  deck = render.deck_path(spec)
  assert _slides(os.path.join(a, "files", deck)) == _slides(os.path.join(b, "files", deck))
  paras = lambda root: [p.text for p in docx.Document(  # noqa: E731
      os.path.join(root, "files", "outputs", "memo.docx")).paragraphs]
  assert paras(a) == paras(b) == ["Memo", "First.", "Second: 3.5"]
  assert _text(b, "files/outputs/avg.txt") == "17.25\n"
  crit = dict(type="mail_sent", to=_actions(spec)[0][1]["to"][0], subject="Q3",
              contains=[{"number": 12.5, "decimals": 1}])
  assert rubric.check(crit, "", pristine, b, envs_cfg).passed


def test_an_app_file_the_agent_broke_fails_its_criteria_not_the_grader(real_world, tmp_path):
  envs_cfg, spec, pristine = real_world
  w = str(tmp_path / "w")
  shutil.copytree(pristine, w)
  sh = shell_tools.ShellTools(w, envs_cfg)
  sh.call("edit", {"path": "apps/mail.json", "old_string": '"messages": [',
                   "new_string": '"messages": [[['})
  sh.call("bash", {"command": "rm apps/calendar.json"})
  task = tasks_lib.Task(
      id="t", split="eval", domain=spec["domain"], world_id="co00", level=3, family="f",
      prompt="p", input_files={}, oracle_steps=(), oracle_answer="42",
      rubric=(dict(type="mail_count", n=1, description="one mail"),
              dict(type="event_count", n=1, description="one event"),
              dict(type="answer_text", text="42", description="says 42")))
  g = tasks_lib.grade(task, "42", pristine, w, envs_cfg)
  assert [r.passed for r in g.results] == [False, False, True]
  assert all("world state unreadable" in r.detail for r in g.results[:2])
