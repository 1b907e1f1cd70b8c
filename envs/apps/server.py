"""The MCP gateway of one world: every app's tools in one stdio MCP server (mcp 2.3 MCPServer).

  python -m envs.apps.server --world_dir <working copy> --envs_json '<config.envs as JSON>'
      [--style mcp|shell]
  python /path/to/repo/envs/apps/server.py --world_dir DIR --envs_json '{}'   # from anywhere

Run as a file it finds the project from its own path, so any MCP client (MCP Inspector, an
agent SDK) can start it from any working directory with the project's interpreter. `--envs_json`
holds the envs keys to change: every key it does not give has the project's default
(configs/base.py's `envs`), so '{}' serves a world with the defaults.

Tool names carry their app as prefix (`spreadsheets_read_sheet`, `mail_send_message`, ...);
with --style shell the server serves the shell tools over the world's folder instead (bash,
read, write, edit, glob, grep; envs.apps.shell_tools), the same way.
Each call runs in a worker thread under a server-side time limit (mcp has none of its own),
and its text is cut to `tool_output_chars`. Failures come back as is_error results whose text
starts with "[kind]" (see envs.apps.tools.ToolFailure): the tools' own kinds, `bad_argument` for
arguments the input schema refuses (missing, mistyped) or the tool does not take (named), and
`unknown_tool`. The server reports
the project's version (pyproject.toml) and advertises only what it serves: tools, a fixed list
(no prompts, resources or subscriptions). The server's `instructions` carry the
world id and the sandbox isolation level, which the server also logs to stderr at start (unless
--quiet: the harness starts one gateway per world and reports the level once itself).
"""
import argparse
import asyncio
import inspect
import json
import logging
import os
import sys

if not __package__:  # run as a file: the project's root instead of this file's folder
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_collections  # pylint: disable=wrong-import-position
from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.exceptions import UnexpectedToolError
import pydantic

from envs import sandbox
from envs import version
from envs.apps import shell_tools
from envs.apps import tools as tools_lib

# What MCPServer registers besides tools; a world serves none of it, so none is advertised.
_UNSERVED = ("prompts/list", "prompts/get", "resources/list", "resources/read",
             "resources/templates/list", "resources/subscribe", "resources/unsubscribe")


class WorldServer(MCPServer):
  """MCPServer whose failed tool calls read "[kind] message", as the tools' own failures do.

  MCPServer words every failure "Error executing tool NAME: ..." and refuses arguments against
  the input schema (a missing or mistyped one) with pydantic's report; this puts the kind first
  (`bad_argument` for the schema's refusals, `unknown_tool` for a name it does not serve,
  `internal` for a crash) so that a client reads the kind from the start of the text.
  """

  tool_names: frozenset = frozenset()  # the tools it serves (build_server sets them)

  world_tools = None  # the tool set it serves (build_server sets it)

  async def call_tool(self, name, arguments, context=None):
    if name in self.tool_names:
      try:  # the input schema's model would drop an argument it does not know
        tools_lib.check_arguments(self.world_tools, name, arguments)
      except tools_lib.ToolFailure as e:
        raise ToolError(str(e)) from None
    try:
      return await super().call_tool(name, arguments, context)
    except UnexpectedToolError as e:
      raise UnexpectedToolError(f"[internal] {name} failed") from e.__cause__
    except ToolError as e:
      raise ToolError(self._kind_first(name, e)) from e.__cause__

  def _kind_first(self, name: str, e: ToolError) -> str:
    cause = e.__cause__
    if isinstance(cause, pydantic.ValidationError):
      what = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}"
                       for err in cause.errors())
      return f"[bad_argument] {name}: {what}"
    if isinstance(cause, ToolError):  # raised by the tool wrapper: already "[kind] ..."
      return str(cause)
    if name not in self.tool_names:
      return f"[unknown_tool] no tool {name!r}"
    return f"[internal] {e}"


def build_server(world_dir: str, envs_cfg, style: str = "mcp") -> WorldServer:
  """A WorldServer (MCPServer) exposing the tools of the world at world_dir (a working copy): the app tools
  (style "mcp") or the shell tools over the world's folder (style "shell")."""
  wt = shell_tools.toolset(style)(world_dir, envs_cfg)
  iso = sandbox.isolation(envs_cfg.sandbox)
  if style == "shell":
    instructions = ("Shell tools over one knowledge-work world: bash, read, write, edit, glob, "
                    "grep. The workspace is the world's folder: files/ (documents) and apps/ "
                    f"(mail.json, chat.json, calendar.json). bash isolation: {iso}")
  else:
    instructions = (f"Apps of one knowledge-work world: {', '.join(tools_lib.APPS)}. Paths are "
                    f"relative to the world's root '/'. code_execution isolation: {iso}")
  server = WorldServer(name=f"world-{os.path.basename(os.path.normpath(world_dir))}",
                       instructions=instructions, log_level="WARNING",
                       version=version.__version__, subscriptions=False)
  handlers = server._lowlevel_server._request_handlers  # pylint: disable=protected-access
  for method in _UNSERVED:
    handlers.pop(method, None)
  server.tool_names = frozenset(wt.TOOL_NAMES)
  limit = float(envs_cfg.tool_time_limit_s)
  cap = int(envs_cfg.tool_output_chars)
  # One call at a time per world: app state is read-modify-written on disk.
  gate = asyncio.Lock()

  def make(name):
    fn = getattr(wt, name)

    async def call(**kwargs):
      async with gate:
        try:
          text = await asyncio.wait_for(asyncio.to_thread(wt.call, name, kwargs), limit)
        except asyncio.TimeoutError:
          wt.cancel.set()  # a sandboxed run is killed; other tools finish on their own
          raise ToolError(f"[timeout] {name} exceeded the {limit:g}s tool time limit") from None
        except tools_lib.ToolFailure as e:
          raise ToolError(str(e)) from None
      return tools_lib.cap_output(text, cap)

    call.__name__ = name
    call.__doc__ = fn.__doc__
    call.__signature__ = inspect.signature(fn)
    call.__annotations__ = dict(fn.__annotations__)
    return call

  for name in wt.TOOL_NAMES:
    fn = getattr(wt, name)
    server.add_tool(make(name), name=name, description=inspect.cleandoc(fn.__doc__ or name),
                    structured_output=False)
  server.world_tools = wt  # for in-process use
  server.isolation = iso
  return server


def envs_config(given: dict) -> ml_collections.ConfigDict:
  """config.envs: the project's defaults (configs/base.py) with the keys `given` sets, nested
  sections merged key by key (a key the defaults lack is kept as given)."""
  from configs import base  # lazy: only the command line needs the defaults

  def merge(into: dict, over: dict) -> dict:
    for k, v in over.items():
      into[k] = merge(dict(into[k]), v) if isinstance(v, dict) and isinstance(
          into.get(k), dict) else v
    return into
  if not isinstance(given, dict):
    raise SystemExit(f"--envs_json must be a JSON object, got {type(given).__name__}")
  return ml_collections.ConfigDict(merge(base.get_config().envs.to_dict(), given))


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--world_dir", required=True)
  ap.add_argument("--envs_json", default="{}",
                  help="config.envs keys as JSON; the rest keep the project's defaults")
  ap.add_argument("--quiet", action="store_true", help="no start line on stderr")
  ap.add_argument("--style", default="mcp", choices=shell_tools.STYLES,
                  help="tool set: the app tools (mcp) or the shell tools (shell)")
  args = ap.parse_args(argv)
  envs_cfg = envs_config(json.loads(args.envs_json))
  logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
  server = build_server(args.world_dir, envs_cfg, args.style)
  if not args.quiet:
    print(f"world gateway {args.world_dir}: isolation {server.isolation}", file=sys.stderr,
          flush=True)
  server.run("stdio")


if __name__ == "__main__":
  main()
