"""Worlds served by MCP servers that are not the project's (config.envs.source = mcp_stdio |
mcp_http), behind the harness's World interface.

mcp_stdio: a server started by a command line, one per working copy of the task's world.
  The world's folder (Task.world_dir, or worlds_root/world_id when that is "") is copied into
  a fresh working directory, `envs.mcp.setup` runs there once (a shell command; e.g. `git init`),
  and the result becomes this process's pristine copy of the world. Each episode then starts
  `envs.mcp.command` (shlex-split, no shell; `{world}` in any of its words is the working
  directory, which is also its current directory) with the extra environment `envs.mcp.env`
  ("K=V,K2=V2"; values may use `{world}`). Its tools are what its `tools/list` answers.
  Between episodes of the same world in one process the working copy is reset to the pristine
  copy plus the task's input files (envs.apps.worldstate.WorldInstance) and the server is
  restarted every episode: a server that is not ours may hold state in memory (open
  repositories, caches, sessions) that a reset of its files would not reach, so only a new
  process is known to see the reset world. The server's standard error goes to
  `<work_root>/mcp-<pid>-<world>.log` (named in crash reports).
  Grading: envs.tasks.grade(task, answer, pristine copy, working copy): criteria that read
  files read the working copy (paths under its files/).

mcp_http: a server already running at `envs.mcp.url` (streamable HTTP). Before each episode
  `envs.mcp.reset` runs: an http(s) URL is POSTed (with the request headers), anything else is
  a shell command (`{world}` = the task's world_dir). Request headers come from the
  environment variable named by `envs.mcp.headers_env` ("Name: value" lines), read in the
  agent process when a world starts and never written anywhere. Grading reads the final
  answer only, unless the task has a world_dir that the server also uses: then criteria that
  read files compare a copy of that folder taken right after the reset (before) with the
  folder itself (after). A task without world_dir whose rubric reads files is refused when its
  episodes are made.

Failures map onto the harness's taxonomy (envs.harness.errors): the process gone or the
connection closed is a world crash, no answer within the timeout a tool timeout, an answer
that is not MCP `malformed_result`; a tool's own error result goes to the policy as a tool
error. Outputs are cut to envs.tool_output_chars client-side (envs.apps.gateway).
"""
import dataclasses
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from typing import Any

import ml_collections

from envs import tasks as tasks_lib
from envs.apps import gateway
from envs.tasks import rubric
from envs.apps.worldstate import WorldInstance
from envs.apps.worldstate import remove_stale_copies
from envs.harness.errors import MalformedResult
from envs.harness.errors import ToolTimeout
from envs.harness.errors import WorldCrashed
from envs.harness.world import Grade
from envs.harness.world import ToolResult
from envs.harness.world import register_exit_hook

SOURCES = ("mcp_stdio", "mcp_http")
# Rubric criteria that read the world's files (the others read the answer or ask a judge).
_WORLD_CRITERIA = frozenset(rubric.WORLD_TYPES)
_PREFIX = "mcp-"
_LOG_TAIL_CHARS = 800


def world_source(task, worlds_root: str) -> str:
  """The folder a task's world is copied from: Task.world_dir, else worlds_root/world_id."""
  return os.path.realpath(task.world_dir or os.path.join(worlds_root, task.world_id))


def world_key(task) -> str:
  """What identifies a task's world for the pool's warm-world scheduling."""
  return task.world_dir or task.world_id


def world_spec(task, config, worlds_root: str, work_root: str = ""):
  """The WorldSpec of one task under config.envs.source (mcp_stdio | mcp_http).

  Raises:
    ValueError: the source is unknown, its settings are missing, or (mcp_http) the task's
      rubric reads world files the task does not have.
  """
  envs = config.envs
  envs_dict = envs.to_dict()
  timeout = float(config.harness.tool_timeout_s)
  if envs.source == "mcp_stdio":
    if not envs.mcp.command.strip():
      raise ValueError("envs.source=mcp_stdio needs envs.mcp.command (the server's command line)")
    src = world_source(task, worlds_root)
    if not os.path.isdir(src):
      raise ValueError(f"task {task.id}: world folder {src} does not exist")
    return McpStdioWorldSpec(task.to_json(), envs_dict, src, work_root, timeout)
  if envs.source == "mcp_http":
    if not envs.mcp.url:
      raise ValueError("envs.source=mcp_http needs envs.mcp.url (the server's streamable-HTTP URL)")
    reads = sorted({c["type"] for c in task.rubric} & _WORLD_CRITERIA)
    if reads and not task.world_dir:
      raise ValueError(f"task {task.id}: criteria {reads} read the world's files, but an mcp_http "
                       "task has files only when it names the server's folder in world_dir")
    return McpHttpWorldSpec(task.to_json(), envs_dict, work_root, timeout)
  raise ValueError(f"envs.source must be one of ('generated',) + {SOURCES}, got {envs.source!r}")


def _grade(task, answer: str, before: str, after: str, cfg) -> Grade:
  g = tasks_lib.grade(task, answer, before, after, cfg)
  return Grade(g.reward, g.passed, {"criteria": [
      dataclasses.asdict(r) if dataclasses.is_dataclass(r) else str(r) for r in g.results]})


def _fill(text: str, world: str) -> str:
  return text.replace("{world}", world)


def server_argv(command: str, world: str) -> list[str]:
  """envs.mcp.command split like a shell would (no shell runs it), `{world}` filled in each
  word; a relative executable path is taken from the current directory."""
  argv = [_fill(w, world) for w in shlex.split(command)]
  if not argv:
    raise ValueError("envs.mcp.command is empty")
  exe = argv[0]
  if os.sep in exe:
    argv[0] = os.path.abspath(exe)
    if not os.access(argv[0], os.X_OK):
      raise ValueError(f"envs.mcp.command: {argv[0]} is not an executable file")
  elif shutil.which(exe) is None:
    raise ValueError(f"envs.mcp.command: {exe!r} is not on PATH")
  return argv


def server_env(spec: str, world: str) -> dict[str, str]:
  """envs.mcp.env ("K=V,K2=V2", values may use {world}) as a dict."""
  out = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    k, sep, v = item.partition("=")
    if not sep or not k.strip():
      raise ValueError(f"envs.mcp.env: {item!r} is not K=V")
    out[k.strip()] = _fill(v, world)
  return out


def request_headers(env_name: str) -> dict[str, str]:
  """Request headers from the environment variable `env_name` ("Name: value" per line).

  Raises:
    ValueError: the variable is not set or a line is not "Name: value" (values never shown).
  """
  if not env_name:
    return {}
  raw = os.environ.get(env_name)
  if raw is None:
    raise ValueError(f"envs.mcp.headers_env names ${env_name}, which is not set")
  out = {}
  for i, line in enumerate(raw.splitlines(), 1):
    if not line.strip():
      continue
    name, sep, value = line.partition(":")
    if not sep or not name.strip() or re.search(r"\s", name.strip()):
      raise ValueError(f"${env_name}: line {i} is not 'Name: value' (its text is not shown)")
    out[name.strip()] = value.strip()
  return out


def _run_shell(what: str, cmd: str, cwd: str | None, timeout: float) -> None:
  try:
    p = subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"{what} did not finish within {timeout:g}s: {cmd!r}") from e
  if p.returncode != 0:
    tail = (p.stderr or p.stdout or "").strip()[-_LOG_TAIL_CHARS:]
    raise RuntimeError(f"{what} failed (exit {p.returncode}): {cmd!r}: {tail}")


def _leaves(e: BaseException) -> str:
  """The messages of the exceptions at the bottom of an exception group (what went wrong)."""
  if isinstance(e, BaseExceptionGroup):  # noqa: F821 (3.11 builtin)
    return "; ".join(_leaves(x) for x in e.exceptions)
  return f"{type(e).__name__}: {e}"


def _tail(path: str | None) -> str:
  if not path:
    return ""
  try:
    with open(path, "rb") as f:
      f.seek(max(0, os.path.getsize(path) - _LOG_TAIL_CHARS))
      return f.read().decode(errors="replace").strip()
  except OSError:
    return ""


class McpWorld:
  """A started external server for one episode: its tools, the taxonomy, grading.

  Args:
    task: the envs.tasks.Task.
    cfg: config.envs.
    server: a started envs.apps.gateway.ExternalServer.
    dirs: (before, after) world folders for grading, or None (final answer only).
    tool_timeout_s: the client's read timeout for one call.
    on_close: called with reuse when the episode ends (after the server is closed).
    log_path: the server's stderr log (its tail goes into crash reports), if any.
  """

  def __init__(self, task, cfg, server, dirs, tool_timeout_s: float, on_close=None,
               log_path: str | None = None):
    self.task, self.cfg, self.server, self.dirs = task, cfg, server, dirs
    self.style = "mcp"  # the tools are the server's, called as MCP tools
    self.tool_timeout_s = tool_timeout_s
    self._on_close = on_close
    self._log = log_path
    self._tools = None

  def tools(self) -> list[dict[str, Any]]:
    if self._tools is None:
      self._tools = [{"type": "function", "function": {
          "name": t["name"], "description": t["description"],
          "parameters": t["input_schema"]}} for t in self.server.list_tools()]
    return self._tools

  def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
    r = self.server.call_tool(name, arguments, timeout=self.tool_timeout_s)
    if r.error_kind == gateway.GATEWAY_CRASH:
      log = _tail(self._log)
      raise WorldCrashed(f"MCP server for {world_key(self.task)} is gone ({r.text[:200]})"
                         + (f"; its log ends: {log}" if log else ""))
    if r.error_kind == gateway.CLIENT_TIMEOUT:
      raise ToolTimeout(r.text)
    if r.error_kind == gateway.MALFORMED_RESULT:
      raise MalformedResult(r.text)
    return ToolResult(r.text, r.is_error)

  def grade(self, final_answer: str) -> Grade:
    before, after = self.dirs or (_empty_dir(), _empty_dir())
    return _grade(self.task, final_answer, before, after, self.cfg)

  def close(self, reuse: bool = False) -> None:
    try:
      self.server.close()
    finally:
      if self._on_close is not None:
        self._on_close(reuse)


# ---------------------------------------------------------------------------------------------
# mcp_stdio


class _Copy:
  """This process's copies of one world: pristine (after setup) and the working copy."""

  def __init__(self, src: str, cfg, work_root: str):
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(src))[:40]
    digest = hashlib.sha1(src.encode()).hexdigest()[:8]
    name = f"{_PREFIX}{os.getpid()}-{slug}-{digest}"
    work = os.path.join(work_root, name)
    self.path = work
    self.base = work + "-pristine"
    self.log = work + ".log"
    for p in (work, self.base):
      shutil.rmtree(p, ignore_errors=True)
    try:
      shutil.copytree(src, work, symlinks=True)
      if cfg.mcp.setup.strip():
        _run_shell("envs.mcp.setup", _fill(cfg.mcp.setup, shlex.quote(work)), work,
                   float(cfg.gateway_start_timeout_s))
      shutil.copytree(work, self.base, symlinks=True)
      self.inst = WorldInstance(self.base, work)
    except BaseException:
      self.close()
      raise

  def close(self) -> None:
    for p in (self.path, self.base):
      shutil.rmtree(p, ignore_errors=True)
    try:
      os.remove(self.log)
    except OSError:
      pass


# Per-process cache of world copies: (world folder, command, setup) -> _Copy. One agent loop per
# process, so at most one entry is live at a time.
_CACHE: dict[tuple[str, str, str], _Copy] = {}
_STARTED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class McpStdioWorldSpec:
  """One task in a world served by an external server started per working copy.

  Attributes:
    task_json: the envs.tasks.Task, as JSON.
    envs_cfg: config.envs as a plain dict (envs.mcp.command/setup/env, timeouts, output cap).
    world_src: the folder the world is copied from (world_source()).
    work_root: parent of the per-process copies ("" = the system temp dir).
    tool_timeout_s: the client's read timeout for one call.
  """
  task_json: str
  envs_cfg: dict
  world_src: str
  work_root: str = ""
  tool_timeout_s: float = 30.0

  def start(self) -> McpWorld:
    task, cfg, work_root = _episode_inputs(self)
    key = (self.world_src, cfg.mcp.command, cfg.mcp.setup)
    for k in [k for k in _CACHE if k != key]:
      _CACHE.pop(k).close()
    copy = _CACHE.pop(key, None)
    if copy is None:
      copy = _Copy(self.world_src, cfg, work_root)
    argv = []
    try:
      copy.inst.reset(task.input_files)
      work = copy.inst.path
      argv = server_argv(cfg.mcp.command, work)
      env = server_env(cfg.mcp.env, work)
      with open(copy.log, "w") as errlog:  # this episode's server; the child keeps its descriptor
        server = gateway.ExternalServer(gateway.stdio_server(argv, work, env, errlog), cfg)
    except ValueError:
      copy.close()
      raise
    except Exception as e:  # noqa: BLE001 - reworded with the server's log, then re-raised
      log = _tail(copy.log)
      copy.close()
      raise RuntimeError(f"MCP server {argv[0] if argv else ''} did not start: {_leaves(e)}"
                         + (f"; its log ends: {log}" if log else "")) from e
    except BaseException:
      copy.close()
      raise

    def done(reuse: bool) -> None:
      if reuse:
        _CACHE[key] = copy
      else:
        copy.close()
    return McpWorld(task, cfg, server, (copy.base, copy.inst.path), self.tool_timeout_s, done,
                    copy.log)


def _episode_inputs(spec) -> tuple:
  """(task, envs config, work root) of an episode of either spec."""
  return (tasks_lib.Task.from_json(spec.task_json), ml_collections.ConfigDict(spec.envs_cfg),
          _once_per_process(spec.work_root))


def _once_per_process(work_root: str) -> str:
  """The work root; on first use in a process, removes copies left by dead agent processes and
  registers the release of ours at exit."""
  root = work_root or tempfile.gettempdir()
  if root not in _STARTED:
    _STARTED.add(root)
    register_exit_hook(release_all)
    remove_stale_copies(root, _PREFIX)
  return root


def release_all() -> None:
  """Removes every cached world copy of this process (servers close with their episodes)."""
  for key in list(_CACHE):
    try:
      _CACHE.pop(key).close()
    except Exception:  # noqa: BLE001 - best effort at exit
      pass
  for d in list(_EMPTY):
    shutil.rmtree(d, ignore_errors=True)
    _EMPTY.remove(d)


_EMPTY: list[str] = []


def _empty_dir() -> str:
  """An empty folder standing for a world that has no files (answer-only grading)."""
  if not _EMPTY:
    _EMPTY.append(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-empty-"))
    register_exit_hook(release_all)
  return _EMPTY[0]


# ---------------------------------------------------------------------------------------------
# mcp_http


def run_reset(hook: str, headers: dict[str, str], world: str, timeout: float) -> None:
  """Runs envs.mcp.reset: POSTs an http(s) URL (2xx expected), else runs it as a shell command
  (`{world}` = the task's world folder). Raises RuntimeError when the reset fails."""
  if not hook.strip():
    return
  if hook.startswith(("http://", "https://")):
    req = urllib.request.Request(hook, data=b"", method="POST", headers=headers)
    try:
      with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
    except urllib.error.HTTPError as e:
      raise RuntimeError(f"envs.mcp.reset: POST {hook} answered HTTP {e.code}") from e
    except (urllib.error.URLError, OSError) as e:
      raise RuntimeError(f"envs.mcp.reset: POST {hook} failed: {e}") from e
    return
  _run_shell("envs.mcp.reset", _fill(hook, shlex.quote(world)) if world else hook, None, timeout)


@dataclasses.dataclass(frozen=True)
class McpHttpWorldSpec:
  """One task against the running server at envs.mcp.url.

  Attributes:
    task_json: the envs.tasks.Task, as JSON.
    envs_cfg: config.envs as a plain dict (envs.mcp.url/reset/headers_env, timeouts, cap).
    work_root: where the before-copy of a task's world_dir goes ("" = the system temp dir).
    tool_timeout_s: the client's read timeout for one call.
  """
  task_json: str
  envs_cfg: dict
  work_root: str = ""
  tool_timeout_s: float = 30.0

  def start(self) -> McpWorld:
    task, cfg, work_root = _episode_inputs(self)
    headers = request_headers(cfg.mcp.headers_env)
    world = os.path.realpath(task.world_dir) if task.world_dir else ""
    run_reset(cfg.mcp.reset, headers, world, float(cfg.gateway_start_timeout_s))
    dirs, before = None, None
    if world:
      before = os.path.join(work_root, f"{_PREFIX}{os.getpid()}-http-before")
      shutil.rmtree(before, ignore_errors=True)
      shutil.copytree(world, before, symlinks=True)
      dirs = (before, world)
    try:
      server = gateway.ExternalServer(gateway.http_server(cfg.mcp.url, headers), cfg)
    except BaseException:
      if before:
        shutil.rmtree(before, ignore_errors=True)
      raise

    def done(reuse: bool) -> None:
      del reuse  # nothing is kept: the next episode resets the server and reconnects
      if before:
        shutil.rmtree(before, ignore_errors=True)
    return McpWorld(task, cfg, server, dirs, self.tool_timeout_s, done)

