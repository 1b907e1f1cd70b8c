"""The MCP gateway of a world: tool schemas, path confinement, limits, error kinds, reset."""
import asyncio
import json
import os
import subprocess
import sys
import tomllib

import mcp
import pytest

from configs import base
from envs import worlds
from envs.apps import gateway as gateway_lib
from envs.apps import server as server_lib
from envs.apps import tools as tools_lib
from envs.apps import worldstate
from envs.worlds import render


@pytest.fixture(scope="module")
def envs_cfg():
  c = base.get_config().envs
  c.tool_output_chars = 3000
  c.tool_time_limit_s = 2.0
  c.sandbox.wall_s = 6.0
  return c


@pytest.fixture(scope="module")
def world(envs_cfg, tmp_path_factory):
  """A pristine world and a working copy with one real gateway process on it."""
  spec = worlds.spec_for(envs_cfg, "investment_banking", 4)
  pristine = str(tmp_path_factory.mktemp("w") / spec["world_id"])
  worlds.generate_world(envs_cfg, spec, pristine)
  inst = worldstate.WorldInstance(pristine, str(tmp_path_factory.mktemp("work") / "in04"))
  gw = gateway_lib.Gateway(inst.path, envs_cfg)
  yield spec, inst, gw
  gw.close()
  inst.close()


def test_tools_have_app_prefixes_and_schemas(world):
  _, _, gw = world
  specs = gw.list_tools()
  names = {t["name"] for t in specs}
  assert names == set(tools_lib.WorldTools.TOOL_NAMES)
  assert {n.split("_")[0] if not n.startswith("code_execution") else "code_execution"
          for n in names} == set(tools_lib.APPS)
  for t in specs:
    assert t["description"] and t["input_schema"]["type"] == "object"
  send = next(t for t in specs if t["name"] == "mail_send_message")
  assert send["input_schema"]["properties"]["to"]["type"] == "array"
  assert set(send["input_schema"]["required"]) == {"to", "subject", "body"}
  assert "isolation" in gw.instructions


@pytest.mark.parametrize("path", ["../", "/../../etc/passwd", "../../apps/mail.json",
                                  "/etc/passwd", "escape_link/passwd"])
def test_paths_outside_the_world_are_refused(world, path):
  _, inst, gw = world
  link = os.path.join(inst.path, "files", "escape_link")
  if not os.path.islink(link):
    os.symlink("/etc", link)
  r = gw.call_tool("filesystem_read_text_file", {"path": path})
  if path == "/etc/passwd":  # read as <world>/etc/passwd: inside, and absent
    assert r.is_error and r.error_kind == "not_found"
  else:
    assert r.is_error and r.error_kind == "path_outside_world", r.text
  r = gw.call_tool("filesystem_write_text_file", {"path": "../../outside.txt", "content": "x"})
  assert r.error_kind == "path_outside_world"
  assert not os.path.exists(os.path.join(os.path.dirname(inst.path), "outside.txt"))
  os.remove(link)


def test_errors_are_classified_and_the_gateway_keeps_serving(world, envs_cfg):
  _, _, gw = world
  assert gw.call_tool("no_such_tool", {}).error_kind == "unknown_tool"
  assert gw.call_tool("pdfs_read_pdf", {"path": "/nope.pdf"}).error_kind == "not_found"
  assert gw.call_tool("mail_send_message", {"to": "x", "subject": "s", "body": "b"}).error_kind == "bad_argument"
  assert gw.call_tool("calendar_create_event", {"title": "t", "date": "2025-13-01", "start": "10:00",
                                                "duration_min": 30, "attendees": []}).error_kind == "bad_argument"
  assert gw.call_tool("pdfs_read_pdf", {"path": "/" + render.SUMMARY_PATH}).error_kind == "unsupported"
  # Server-side time limit: the call returns an error in time and the gateway still answers.
  r = gw.call_tool("code_execution_run_python", {"code": "import time; time.sleep(4)"})
  assert r.is_error and r.error_kind == "timeout", r.text
  ok = gw.call_tool("filesystem_list_directory", {"path": "/"})
  assert not ok.is_error and "models/" in ok.text


@pytest.mark.parametrize("name,args,kind,needle", [
    ("pdfs_read_pdf", {"path": "/nope.pdf"}, "not_found", "/nope.pdf"),
    ("pdfs_read_pdf", {}, "bad_argument", "path: Field required"),  # a missing argument
    ("calendar_create_event", {"title": "t", "date": "2025-01-02", "start": "10:00",
                               "duration_min": "half an hour", "attendees": []},
     "bad_argument", "duration_min: Input should be a valid integer"),  # a mistyped one
    ("mail_send_message", {"to": "x", "subject": "s", "body": "b"}, "bad_argument",
     "to: Input should be a valid list"),
    ("no_such_tool", {}, "unknown_tool", "no_such_tool"),
])
def test_every_error_text_starts_with_its_kind(world, name, args, kind, needle):
  _, _, gw = world
  r = gw.call_tool(name, args)
  assert r.is_error and r.error_kind == kind, r.text
  assert r.text.startswith(f"[{kind}] ") and needle in r.text, r.text
  assert "Error executing tool" not in r.text


def test_server_runs_from_any_directory_with_default_envs_and_names_unknown_arguments(
    world, tmp_path):
  """`python <repo>/envs/apps/server.py --envs_json '{}'`, started by an MCP client in a folder
  outside the repository with no PYTHONPATH, serves the world with the project's defaults for
  every envs key; an argument a tool does not take is refused with `[bad_argument]` naming it,
  over MCP and in process alike (the input schema's model used to drop it silently)."""
  spec, inst, _ = world
  inst.reset()
  outside = tmp_path / "elsewhere"
  outside.mkdir()
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  argv = [sys.executable, os.path.join(repo, "envs", "apps", "server.py"), "--world_dir",
          inst.path, "--envs_json", "{}"]
  defaults = base.get_config().envs
  path = "/" + render.entity_paths(spec, spec["entities"][1])["xlsx"]
  bad_args = {"path": path, "sheeet": "Financials", "limit": 3}
  with gateway_lib.ExternalServer(gateway_lib.stdio_server(argv, cwd=str(outside), env={}),
                                  defaults) as ext:
    assert {t["name"] for t in ext.list_tools()} == set(tools_lib.WorldTools.TOOL_NAMES)
    ok = ext.call_tool("spreadsheets_read_sheet", {"path": path})
    assert not ok.is_error, ok.text
    bad = ext.call_tool("spreadsheets_read_sheet", bad_args)
  local = gateway_lib.LocalGateway(inst.path, defaults).call_tool("spreadsheets_read_sheet",
                                                                  bad_args)
  assert local.error_kind == "bad_argument"   # (a server not ours gets no kind read from it)
  for r in (bad, local):
    assert r.is_error, r.text
    assert r.text.startswith("[bad_argument] spreadsheets_read_sheet: unknown arguments "
                             "'sheeet', 'limit'"), r.text
  # Keys given override the defaults, nested sections key by key.
  cfg = server_lib.envs_config({"tool_output_chars": 77, "sandbox": {"wall_s": 1.5}})
  assert (cfg.tool_output_chars, cfg.sandbox.wall_s) == (77, 1.5)
  assert cfg.sandbox.memory_mb == defaults.sandbox.memory_mb
  assert server_lib.envs_config({}).to_dict() == defaults.to_dict()


def test_server_reports_the_project_version_and_only_the_tools_capability(world, envs_cfg):
  _, inst, _ = world
  with open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))), "pyproject.toml"), "rb") as f:
    want = tomllib.load(f)["project"]["version"]
  srv = server_lib.build_server(inst.path, envs_cfg)

  async def go(mode):
    async with mcp.Client(srv, mode=mode) as c:
      info, caps = c.server_info, c.server_capabilities
      with pytest.raises(mcp.MCPError):
        await c.list_prompts()
      return info, caps
  for mode in ("legacy", "auto"):
    info, caps = asyncio.run(go(mode))
    assert info.version == want and want
    assert caps.tools is not None and not caps.tools.list_changed
    assert (caps.prompts, caps.resources, caps.logging, caps.completions) == (None,) * 4


def test_output_is_capped(world, envs_cfg):
  _, _, gw = world
  r = gw.call_tool("code_execution_run_python", {"code": "print('x' * 100000)"})
  assert not r.is_error
  assert len(r.text) <= envs_cfg.tool_output_chars + 100 and "truncated" in r.text


def test_reset_restores_the_pristine_world_and_snapshots_round_trip(world, tmp_path):
  spec, inst, gw = world
  e = spec["entities"][0]
  gw.call_tool("mail_send_message", {"to": [spec["people"][1]["email"]], "subject": "s", "body": "b"})
  gw.call_tool("spreadsheets_write_cell", {"path": "/" + render.SUMMARY_PATH, "sheet": "Summary",
                                           "cell": "B2", "value": "7.5"})
  gw.call_tool("filesystem_write_text_file", {"path": "/outputs/new/deep/x.txt", "content": "hi"})
  gw.call_tool("presentations_add_slide", {"path": "/" + render.deck_path(spec), "title": "T",
                                           "bullets": ["b"]})
  os.remove(os.path.join(inst.path, "files", render.entity_paths(spec, e)["pdf"]))
  snap = inst.snapshot(str(tmp_path / "snap"))
  assert worldstate._manifest(inst.path) != worldstate._manifest(inst.pristine)
  inst.reset({"inputs/req.txt": "hello"})
  man = worldstate._manifest(inst.path)
  assert man.pop(os.path.join("files", "inputs", "req.txt"))[0] == 5
  assert man == worldstate._manifest(inst.pristine)
  for rel in man:
    with open(os.path.join(inst.path, rel), "rb") as a, open(os.path.join(inst.pristine, rel), "rb") as b:
      assert a.read() == b.read(), rel
  assert not os.path.exists(os.path.join(inst.path, "files", "outputs", "new"))
  assert os.path.isdir(os.path.join(inst.path, "files", "outputs"))
  # The same gateway process serves the next episode on the restored state.
  r = gw.call_tool("mail_list_messages", {"folder": "sent"})
  assert r.text == "(no messages)"
  inst.restore(snap)
  assert "s000" in gw.call_tool("mail_list_messages", {"folder": "sent"}).text
  inst.reset()


def test_local_gateway_matches_mcp(world, envs_cfg):
  spec, inst, gw = world
  inst.reset()
  local = gateway_lib.LocalGateway(inst.path, envs_cfg)
  args = {"path": "/" + render.entity_paths(spec, spec["entities"][1])["xlsx"]}
  assert local.call_tool("spreadsheets_read_sheet", args).text == \
      gw.call_tool("spreadsheets_read_sheet", args).text
  assert [t["name"] for t in local.list_tools()] == [t["name"] for t in gw.list_tools()]


@pytest.mark.parametrize("quiet", [False, True])
def test_server_announces_isolation_on_stderr_unless_quiet(world, envs_cfg, quiet):
  _, inst, _ = world
  cmd = [sys.executable, "-m", "envs.apps.server", "--world_dir", inst.path,
         "--envs_json", json.dumps(envs_cfg.to_dict())] + (["--quiet"] if quiet else [])
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  # stdin at EOF: the stdio server starts, finds no client and exits.
  p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=repo,
                     timeout=60)
  assert ("isolation" in p.stderr) != quiet, p.stderr
