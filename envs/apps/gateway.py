"""Clients of MCP servers: the world's own gateway (a stdio MCP server process, or the same tools
in-process) and external MCP servers (any command over stdio, or a streamable-HTTP URL).

  inst = WorldInstance(pristine_dir, work_dir)      # envs.apps.worldstate
  with Gateway(inst.path, config.envs) as gw:       # spawns `python -m envs.apps.server`
    tools = gw.list_tools()                         # [{name, description, input_schema}]
    r = gw.call_tool("pdfs_read_pdf", {"path": "/reports/x.pdf"}, timeout=30)
    r.text, r.is_error, r.error_kind
    inst.reset(task.input_files)                    # next episode, same process

  with ExternalServer(stdio_server(["mcp-server-git", "-r", repo], cwd=repo), config.envs) as s:
    s.list_tools(); s.call_tool("git_status", {"repo_path": repo})
  ExternalServer(http_server(url, headers), config.envs)   # a running streamable-HTTP server

`Gateway` is synchronous (it owns an event loop thread), for agent loops written as plain
code; `AsyncGateway` is the same over asyncio. `LocalGateway` runs the tools in-process
without MCP (fast grading checks); its results are identical apart from transport errors.
Each takes a `style`: "mcp" (the app tools, the default) or "shell" (bash, read, write, edit,
glob, grep over the world's folder; envs.apps.shell_tools). `ExternalServer`/`AsyncExternalServer`
speak to a server that is not ours; both kinds share the transport and its failure modes
(`_AsyncMcpClient`).

Error kinds in ToolResult.error_kind:
  transport (both kinds)  "client_timeout" (no answer within the timeout), "gateway_crash" (the
                          process is gone or the connection closed), "malformed_result" (the
                          server's reply is not valid MCP: a line that is not JSON-RPC, or a
                          result of the wrong shape; envs.harness.errors.MALFORMED_RESULT)
  the project's gateway   the tool's own ("path_outside_world", "not_found", "bad_argument",
                          "unsupported", "timeout", "internal", "unknown_tool"; arguments the input
                          schema refuses are "bad_argument"). The server puts the kind first in
                          every error text ("[kind] message"; envs.apps.server.WorldServer).
  an external server      "tool_error" (the tool's own isError result, its text unchanged),
                          "unknown_tool" / "bad_argument" (a JSON-RPC error naming an unknown tool
                          / invalid params), "server_error" (any other JSON-RPC error). Its texts
                          carry no kind: the kind comes from what happened, and the texts the
                          client writes itself start with "[kind]".
An external server's tool output is cut to envs.tool_output_chars here (the server is not
ours to limit); non-text content blocks are shown as a one-line placeholder.
"""
import asyncio
import dataclasses
import json
import os
import re
import sys
import threading

import httpx2
import mcp
import mcp.types as mcp_types
import pydantic
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

from envs.apps import server
from envs.apps import shell_tools
from envs.apps import tools as tools_lib

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_KIND_RE = re.compile(r"^\[([a-z_]+)\]")

CLIENT_TIMEOUT = "client_timeout"
GATEWAY_CRASH = "gateway_crash"
MALFORMED_RESULT = "malformed_result"
TOOL_ERROR = "tool_error"


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


class _AsyncMcpClient:
  """One MCP connection and the transport's failure modes, shared by every server kind.

  Subclasses give the server (`_server`) and word what the server itself said (`_from_error`
  for a JSON-RPC error, `_from_result` for a tool result).
  """

  _cache = dataclasses.MISSING  # mcp.Client's response cache: its default unless overridden

  def __init__(self, envs_cfg):
    self.cfg = envs_cfg
    self._client = None
    self._bad_message = None   # set when the transport delivers a message it could not parse
    self.instructions = ""

  def _server(self):
    raise NotImplementedError

  async def _on_message(self, message) -> None:
    # The transport hands over what it could not read as an exception: the pending call (one
    # at a time per connection) would otherwise wait for its timeout.
    waiting = self._bad_message
    if isinstance(message, Exception) and waiting is not None and not waiting.done():
      waiting.set_result(message)

  async def start(self):
    kw = {} if self._cache is dataclasses.MISSING else {"cache": self._cache}
    self._client = mcp.Client(self._server(), read_timeout_seconds=float(self.cfg.client_timeout_s),
                              mode="legacy", message_handler=self._on_message, **kw)
    await asyncio.wait_for(self._client.__aenter__(), float(self.cfg.gateway_start_timeout_s))
    self.instructions = self._client.instructions or ""
    return self

  async def list_tools(self) -> list:
    return tool_specs(await self._client.list_tools())

  async def call_tool(self, name: str, args: dict, timeout: float = None) -> ToolResult:
    t = float(timeout if timeout is not None else self.cfg.client_timeout_s)
    self._bad_message = asyncio.get_running_loop().create_future()
    call = asyncio.ensure_future(asyncio.wait_for(
        self._client.call_tool(name, args or {}, read_timeout_seconds=t), t + 5))
    try:
      await asyncio.wait([call, self._bad_message], return_when=asyncio.FIRST_COMPLETED)
      if not call.done():
        call.cancel()
        e = self._bad_message.result()
        return ToolResult(f"[{MALFORMED_RESULT}] {name}: the server sent a message that is not "
                          f"valid JSON-RPC ({type(e).__name__}: {str(e)[:300]})", True,
                          MALFORMED_RESULT)
      r = call.result()
    except (asyncio.TimeoutError, TimeoutError):
      return ToolResult(f"[client_timeout] {name} gave no answer within {t:g}s", True,
                        "client_timeout")
    except mcp.MCPError as e:
      return self._from_error(name, e)
    except pydantic.ValidationError as e:
      return ToolResult(f"[{MALFORMED_RESULT}] {name}: the result is not a valid MCP tool result "
                        f"({str(e)[:300]})", True, MALFORMED_RESULT)
    except (OSError, EOFError, RuntimeError, BaseExceptionGroup) as e:  # noqa: F821 (3.11 builtin)
      return ToolResult(f"[gateway_crash] {type(e).__name__}: {e}", True, "gateway_crash")
    finally:
      if not call.done():
        call.cancel()
      self._bad_message = None
    return self._from_result(name, r)

  def _from_error(self, name: str, e) -> ToolResult:
    raise NotImplementedError

  def _from_result(self, name: str, r) -> ToolResult:
    raise NotImplementedError

  async def close(self):
    if self._client is not None:
      c, self._client = self._client, None
      try:
        await asyncio.wait_for(c.__aexit__(None, None, None), 10)
      except Exception:  # the process is gone either way; closing must not raise
        pass


class AsyncGateway(_AsyncMcpClient):
  """A gateway process for one world directory, spoken to over stdio MCP."""

  def __init__(self, world_dir: str, envs_cfg, style: str = "mcp"):
    super().__init__(envs_cfg)
    self.world_dir = os.path.abspath(world_dir)
    self.style = shell_tools.check_style(style)

  def _server(self):
    return mcp.StdioServerParameters(
        command=sys.executable,
        args=["-m", "envs.apps.server", "--world_dir", self.world_dir, "--quiet",
              "--style", self.style, "--envs_json", json.dumps(self.cfg.to_dict())],
        env={"PYTHONPATH": _REPO, "PYTHONUNBUFFERED": "1"}, cwd=_REPO)

  def _from_error(self, name: str, e) -> ToolResult:
    msg = str(e)
    kind = "client_timeout" if "timed out" in msg.lower() else _kind_of(msg)
    return ToolResult(msg if _KIND_RE.match(msg) else f"[{kind}] {msg}", True, kind)

  def _from_result(self, name: str, r) -> ToolResult:
    text = "\n".join(c.text for c in r.content if getattr(c, "type", "") == "text")
    if r.is_error:
      return ToolResult(text, True, _kind_of(text))
    return ToolResult(text, False, None)


def stdio_server(argv: list, cwd: str, env: dict = None, errlog=None):
  """An external server started as `argv` (no shell) in `cwd`, over stdio.

  Args:
    argv: the command line, already split.
    cwd: its working directory.
    env: extra environment, over the MCP client's default one (PATH, HOME, ...; not the whole
      environment of this process, which may hold secrets).
    errlog: a file its standard error goes to (default: this process's stderr).
  """
  if not argv:
    raise ValueError("an MCP server command line is empty (envs.mcp.command)")
  params = mcp.StdioServerParameters(command=argv[0], args=list(argv[1:]), env=dict(env or {}),
                                     cwd=cwd)
  return stdio_client(params, errlog=errlog or sys.stderr)


def http_server(url: str, headers: dict = None):
  """A running external server at `url`, over streamable HTTP, with optional request headers."""
  if not url.startswith(("http://", "https://")):
    raise ValueError(f"envs.mcp.url must be an http(s) URL, got {url!r}")
  client = httpx2.AsyncClient(headers=dict(headers or {}), follow_redirects=False,
                              timeout=httpx2.Timeout(30.0, read=300.0))
  return streamable_http_client(url, http_client=client)


class AsyncExternalServer(_AsyncMcpClient):
  """An MCP server that is not ours (envs.harness.mcp_worlds), over any transport.

  Args:
    transport: stdio_server(...) or http_server(...).
    envs_cfg: config.envs (client_timeout_s, gateway_start_timeout_s, tool_output_chars).
  """

  _cache = None  # the server is not ours: nothing it answered is served again from a cache

  def __init__(self, transport, envs_cfg):
    super().__init__(envs_cfg)
    self._transport = transport
    self.cap = int(envs_cfg.tool_output_chars)

  def _server(self):
    return self._transport

  def _from_error(self, name: str, e) -> ToolResult:
    msg = e.message
    if e.code == mcp_types.REQUEST_TIMEOUT:
      kind = CLIENT_TIMEOUT
    elif e.code == mcp_types.CONNECTION_CLOSED:
      kind = GATEWAY_CRASH
    elif e.code == mcp_types.PARSE_ERROR:
      kind = MALFORMED_RESULT
    elif "unknown tool" in msg.lower() or e.code == mcp_types.METHOD_NOT_FOUND:
      kind = "unknown_tool"
    elif e.code == mcp_types.INVALID_PARAMS:
      kind = "bad_argument"
    else:
      kind = "server_error"
    return ToolResult(tools_lib.cap_output(f"[{kind}] {msg}", self.cap), True, kind)

  def _from_result(self, name: str, r) -> ToolResult:
    text = tools_lib.cap_output("\n".join(_block_text(c) for c in r.content), self.cap)
    if r.is_error:
      return ToolResult(text, True, TOOL_ERROR)
    return ToolResult(text, False, None)


def _block_text(c) -> str:
  """One content block as the policy sees it: text as is, other kinds as a placeholder."""
  kind = getattr(c, "type", "")
  if kind == "text":
    return c.text
  if kind == "resource":
    res = c.resource
    return getattr(res, "text", None) or f"[resource {res.uri} ({res.mime_type or 'binary'})]"
  if kind == "resource_link":
    return f"[resource link {c.uri}]"
  if kind in ("image", "audio"):
    return f"[{kind} ({c.mime_type}, {len(c.data)} base64 characters)]"
  return f"[{kind} content]"


class _SyncClient:
  """Synchronous facade over an _AsyncMcpClient (its own event-loop thread)."""

  def __init__(self, make_async):
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
    self._thread.start()
    try:
      self._gw = make_async()
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
        if hasattr(self, "_gw"):
          self._run(self._gw.close())
      finally:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class Gateway(_SyncClient):
  """Synchronous facade over AsyncGateway (its own event-loop thread)."""

  def __init__(self, world_dir: str, envs_cfg, style: str = "mcp"):
    shell_tools.check_style(style)
    super().__init__(lambda: AsyncGateway(world_dir, envs_cfg, style))


class ExternalServer(_SyncClient):
  """Synchronous facade over AsyncExternalServer (its own event-loop thread)."""

  def __init__(self, transport, envs_cfg):
    super().__init__(lambda: AsyncExternalServer(transport, envs_cfg))


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
