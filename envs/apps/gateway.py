"""Clients of a world's gateway: a real stdio MCP server process, or the same tools in-process.

  inst = WorldInstance(pristine_dir, work_dir)      # envs.apps.worldstate
  with Gateway(inst.path, config.envs) as gw:       # spawns `python -m envs.apps.server`
    tools = gw.list_tools()                         # [{name, description, input_schema}]
    r = gw.call_tool("pdfs_read_pdf", {"path": "/reports/x.pdf"}, timeout=30)
    r.text, r.is_error, r.error_kind
    inst.reset(task.input_files)                    # next episode, same process

`Gateway` is synchronous (it owns an event loop thread), for agent loops written as plain
code; `AsyncGateway` is the same over asyncio. `LocalGateway` runs the tools in-process
without MCP (fast grading checks); its results are identical apart from transport errors.
Each takes a `style`: "mcp" (the app tools, the default) or "shell" (bash, read, write, edit,
glob, grep over the world's folder; envs.apps.shell_tools).

Error kinds in ToolResult.error_kind: the tool's own ("path_outside_world", "not_found",
"bad_argument", "unsupported", "timeout", "internal", "unknown_tool"; arguments the input schema
refuses are "bad_argument") or the transport's ("client_timeout", "gateway_crash"). The server
puts the kind first in every error text ("[kind] message"; envs.apps.server.WorldServer).
"""
import asyncio
import dataclasses
import json
import os
import re
import sys
import threading

import mcp

from envs.apps import server
from envs.apps import shell_tools
from envs.apps import tools as tools_lib

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_KIND_RE = re.compile(r"^\[([a-z_]+)\]")


@dataclasses.dataclass
class ToolResult:
  text: str
  is_error: bool
  error_kind: str = None


def _kind_of(text: str) -> str:
  m = _KIND_RE.match(text)
  if m:
    return m.group(1)
  # A text without a kind comes from the MCP layer itself (the server words all of its own).
  if "Unknown tool" in text or "not found" in text.lower():
    return "unknown_tool"
  return "bad_argument"


def tool_specs(list_tools_result) -> list:
  return [dict(name=t.name, description=t.description or "", input_schema=t.input_schema)
          for t in list_tools_result.tools]


class AsyncGateway:
  """A gateway process for one world directory, spoken to over stdio MCP."""

  def __init__(self, world_dir: str, envs_cfg, style: str = "mcp"):
    self.world_dir = os.path.abspath(world_dir)
    self.cfg = envs_cfg
    self.style = shell_tools.check_style(style)
    self._client = None
    self.instructions = ""

  async def start(self):
    params = mcp.StdioServerParameters(
        command=sys.executable,
        args=["-m", "envs.apps.server", "--world_dir", self.world_dir, "--quiet",
              "--style", self.style, "--envs_json", json.dumps(self.cfg.to_dict())],
        env={"PYTHONPATH": _REPO, "PYTHONUNBUFFERED": "1"}, cwd=_REPO)
    self._client = mcp.Client(params, read_timeout_seconds=float(self.cfg.client_timeout_s),
                              mode="legacy")
    await asyncio.wait_for(self._client.__aenter__(), float(self.cfg.gateway_start_timeout_s))
    self.instructions = self._client.instructions or ""
    return self

  async def list_tools(self) -> list:
    return tool_specs(await self._client.list_tools())

  async def call_tool(self, name: str, args: dict, timeout: float = None) -> ToolResult:
    t = float(timeout if timeout is not None else self.cfg.client_timeout_s)
    try:
      r = await asyncio.wait_for(self._client.call_tool(name, args or {}, read_timeout_seconds=t),
                                 t + 5)
    except (asyncio.TimeoutError, TimeoutError):
      return ToolResult(f"[client_timeout] {name} gave no answer within {t:g}s", True,
                        "client_timeout")
    except mcp.MCPError as e:
      msg = str(e)
      kind = "client_timeout" if "timed out" in msg.lower() else _kind_of(msg)
      return ToolResult(msg if _KIND_RE.match(msg) else f"[{kind}] {msg}", True, kind)
    except (OSError, EOFError, RuntimeError, BaseExceptionGroup) as e:  # noqa: F821 (3.11 builtin)
      return ToolResult(f"[gateway_crash] {type(e).__name__}: {e}", True, "gateway_crash")
    text = "\n".join(c.text for c in r.content if getattr(c, "type", "") == "text")
    if r.is_error:
      return ToolResult(text, True, _kind_of(text))
    return ToolResult(text, False, None)

  async def close(self):
    if self._client is not None:
      c, self._client = self._client, None
      try:
        await asyncio.wait_for(c.__aexit__(None, None, None), 10)
      except Exception:  # the process is gone either way; closing must not raise
        pass


class Gateway:
  """Synchronous facade over AsyncGateway (its own event-loop thread)."""

  def __init__(self, world_dir: str, envs_cfg, style: str = "mcp"):
    shell_tools.check_style(style)
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
    self._thread.start()
    self._gw = AsyncGateway(world_dir, envs_cfg, style)
    try:
      self._run(self._gw.start())
    except BaseException:
      self.close()
      raise

  @property
  def instructions(self) -> str:
    return self._gw.instructions

  def _run(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

  def list_tools(self) -> list:
    return self._run(self._gw.list_tools())

  def call_tool(self, name: str, args: dict, timeout: float = None) -> ToolResult:
    return self._run(self._gw.call_tool(name, args, timeout))

  def close(self):
    if self._loop.is_running():
      try:
        self._run(self._gw.close())
      finally:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class LocalGateway:
  """The same tools called in-process (no MCP, no subprocess): for fast grading checks."""

  def __init__(self, world_dir: str, envs_cfg, style: str = "mcp"):
    self.style = style
    self.tools = shell_tools.toolset(style)(world_dir, envs_cfg)
    self.cap = int(envs_cfg.tool_output_chars)
    self.instructions = "in-process tools"

  def list_tools(self) -> list:
    srv = server.build_server(self.tools.world_dir, self.tools.cfg, self.style)

    async def go():
      async with mcp.Client(srv) as c:
        return tool_specs(await c.list_tools())
    return asyncio.run(go())

  def call_tool(self, name: str, args: dict, timeout: float = None) -> ToolResult:
    del timeout  # in-process calls are not interruptible; use Gateway for limits
    try:
      return ToolResult(tools_lib.cap_output(self.tools.call(name, args), self.cap), False)
    except tools_lib.ToolFailure as e:
      return ToolResult(str(e), True, e.kind)

  def close(self):
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
