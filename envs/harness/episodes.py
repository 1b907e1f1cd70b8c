"""Episodes of tasks for the harness (`task_episodes`): the agent worlds (envs.worlds, envs.apps,
envs.tasks) behind the harness's World interface.

A `GatewayWorldSpec` carries one task to an agent-loop process. There it gets a working copy
of the task's world and a stdio MCP gateway process (envs.apps.gateway.Gateway). The pair is
kept for the next episode of the same world in that process (reset to pristine plus the
task's input files, far cheaper than a new gateway), unless the episode ended in a way that
leaves the world suspect (a timeout, a crash), in which case it is killed.

`config.harness.style` picks the tools the gateway serves: "mcp", the app tools, or "shell",
bash, read, write, edit, glob and grep over the world's folder (envs.apps.shell_tools; its
episodes carry a system prompt that describes the workspace). Grading is the same either way.

The world of a task is worlds_root/world_id, or the task's own folder when Task.world_dir is
set (tasks read from files, in a folder with the same files/ + apps/ layout). `task_episodes`
follows config.envs.source: "generated" (these gateway worlds) or an external MCP server,
"mcp_stdio" | "mcp_http" (envs.harness.mcp_worlds).
"""
import dataclasses
import hashlib
import os
import re
import tempfile
from typing import Any

import ml_collections

from envs import tasks as tasks_lib
from envs.apps import shell_tools
from envs.apps.gateway import Gateway
from envs.apps.worldstate import WorldInstance
from envs.apps.worldstate import remove_stale_copies
from envs.harness import mcp_worlds
from envs.harness.errors import MalformedResult
from envs.harness.errors import ToolTimeout
from envs.harness.errors import WorldCrashed
from envs.harness.world import Episode
from envs.harness.world import Grade
from envs.harness.world import ToolResult
from envs.harness.world import register_exit_hook

# Gateway error kinds that mean the gateway itself is gone or wedged, not a tool failure.
_CRASH_KINDS = ("gateway_crash",)
_TIMEOUT_KINDS = ("client_timeout",)
_MALFORMED_KINDS = ("malformed_result",)

# Per-process cache of started worlds: (world key, style) -> (WorldInstance, Gateway, tools,
# gateway pid). One agent loop per process, so at most one entry is live at a time.
_CACHE: dict[tuple[str, str], tuple[Any, Any]] = {}


@dataclasses.dataclass(frozen=True)
class GatewayWorldSpec:
  """One task in its world.

  Attributes:
    task_json: the envs.tasks.Task, as JSON.
    envs_cfg: config.envs as a plain dict.
    worlds_root: where the worlds are rendered (envs.worlds.ensure_worlds).
    work_root: parent of the per-process working copies ("" = the system temp dir).
    tool_timeout_s: the gateway client's read timeout for one call.
    style: the tools served (config.harness.style): mcp | shell.
  """
  task_json: str
  envs_cfg: dict
  worlds_root: str
  work_root: str = ""
  tool_timeout_s: float = 30.0
  style: str = "mcp"

  def start(self) -> "GatewayWorld":
    shell_tools.check_style(self.style)
    work_root = self.work_root or tempfile.gettempdir()
    _once_per_process(work_root)
    task = tasks_lib.Task.from_json(self.task_json)
    cfg = ml_collections.ConfigDict(self.envs_cfg)
    src = mcp_worlds.world_source(task, self.worlds_root)
    key = (src, self.style)
    for k in [k for k in _CACHE if k != key]:
      _drop(k)
    if key in _CACHE:
      inst, gw, tools, pid = _CACHE.pop(key)
      try:
        # The gateway may have died since the last episode: check before handing it out.
        world = GatewayWorld(task, cfg, inst, gw, self.tool_timeout_s, tools, pid, self.style)
        if not world._gateway_alive():
          raise WorldCrashed("cached gateway is gone")
        inst.reset(task.input_files)
        return world
      except Exception:  # noqa: BLE001 - a broken cached world is replaced below
        _close(inst, gw)
    name = task.world_id if not task.world_dir else _slug(task.world_dir)
    work = os.path.join(work_root, f"{_PREFIX}{os.getpid()}-{name}")
    inst = WorldInstance(src, work)
    try:
      inst.reset(task.input_files)
      gw = Gateway(inst.path, cfg, self.style)
    except BaseException:
      inst.close()
      raise
    return GatewayWorld(task, cfg, inst, gw, self.tool_timeout_s, style=self.style)


class GatewayWorld:
  """A started world: the gateway's tools, grading against the task's rubric."""

  def __init__(self, task, cfg, inst, gateway, tool_timeout_s: float, tools=None,
               pid: int | None = None, style: str = "mcp"):
    self.task, self.cfg, self.inst, self.gw = task, cfg, inst, gateway
    self.style = style    # the tools served: mcp | shell (envs.harness.tool_subset reads it)
    self.tool_timeout_s = tool_timeout_s
    self._tools = tools   # the same world serves the same tools: listed once per gateway
    self._pid = pid       # the gateway's process id, found once

  def _gateway_alive(self) -> bool:
    """Whether the gateway process serving this working copy is alive (Linux /proc)."""
    if not os.path.isdir("/proc"):
      return True  # cannot tell: trust the gateway's own error kind
    if self._pid is None:
      self._pid = _find_child(("--world_dir\0" + self.inst.path + "\0").encode())
      if self._pid is None:
        return False
    try:
      with open(f"/proc/{self._pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
      return int(fields[1]) == os.getpid() and fields[0] != b"Z"
    except (OSError, IndexError, ValueError):
      return False

  def tools(self) -> list[dict[str, Any]]:
    if self._tools is None:
      self._tools = [{"type": "function", "function": {
          "name": t["name"], "description": t["description"],
          "parameters": t["input_schema"]}} for t in self.gw.list_tools()]
    return self._tools

  def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
    r = self.gw.call_tool(name, arguments, timeout=self.tool_timeout_s)
    # A dead gateway can surface as an ordinary-looking error ("Connection closed"), so on
    # any error the process itself is checked.
    if r.is_error and (r.error_kind in _CRASH_KINDS or not self._gateway_alive()):
      raise WorldCrashed(f"gateway process for {self.task.world_id} is gone ({r.text[:200]})")
    if r.is_error and r.error_kind in _TIMEOUT_KINDS:
      raise ToolTimeout(r.text)
    if r.is_error and r.error_kind in _MALFORMED_KINDS:
      raise MalformedResult(r.text)
    return ToolResult(r.text, r.is_error)

  def grade(self, final_answer: str) -> Grade:
    g = tasks_lib.grade(self.task, final_answer, self.inst.pristine, self.inst.path, self.cfg)
    return Grade(g.reward, g.passed, {"criteria": [
        dataclasses.asdict(r) if dataclasses.is_dataclass(r) else str(r) for r in g.results]})

  def close(self, reuse: bool = False) -> None:
    if reuse:
      _CACHE[(self.inst.pristine, self.style)] = (self.inst, self.gw, self._tools, self._pid)
    else:
      _close(self.inst, self.gw)


def _find_child(marker: bytes) -> int | None:
  """A live child process of ours whose command line contains `marker`."""
  me = os.getpid()
  for d in os.listdir("/proc"):
    if not d.isdigit():
      continue
    try:
      with open(f"/proc/{d}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
      if int(fields[1]) != me or fields[0] == b"Z":
        continue
      with open(f"/proc/{d}/cmdline", "rb") as f:
        if marker in f.read():
          return int(d)
    except (OSError, IndexError, ValueError):
      continue
  return None


_PREFIX = "harness-"
_STARTED: set[str] = set()


def _once_per_process(work_root: str) -> None:
  """First world start in a process: remove working copies left by dead agent processes
  (killed workers cannot clean up after themselves), and release ours at exit."""
  if work_root in _STARTED:
    return
  _STARTED.add(work_root)
  register_exit_hook(release_all)
  remove_stale_copies(work_root, _PREFIX)


def _slug(path: str) -> str:
  """A file-name-safe label of a world folder, unique per folder."""
  base = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(os.path.normpath(path)))[:40]
  return f"{base}-{hashlib.sha1(os.path.realpath(path).encode()).hexdigest()[:8]}"


def release_all() -> None:
  """Closes every cached world of this process (gateway processes and working copies)."""
  for key in list(_CACHE):
    try:
      _drop(key)
    except Exception:  # noqa: BLE001 - best effort at exit
      pass


def _close(inst, gw) -> None:
  try:
    gw.close()
  finally:
    inst.close()


def _drop(key: tuple[str, str]) -> None:
  inst, gw = _CACHE.pop(key)[:2]
  _close(inst, gw)


def task_episodes(tasks, config, samples_per_task: int = 1, first_group: int = 0,
                  worlds_root: str | None = None, work_root: str = "") -> list[Episode]:
  """Episodes for a list of envs.tasks.Task: `samples_per_task` per task, one group each.

  With config.envs.source "generated" the worlds serve the tools of config.harness.style; with
  "mcp_stdio" / "mcp_http" they are external MCP servers (envs.harness.mcp_worlds), whose tools
  are their own (harness.style does not apply).
  """
  source = config.envs.source
  if source != "generated" and source not in mcp_worlds.SOURCES:
    raise ValueError(f"envs.source must be one of ('generated',) + {mcp_worlds.SOURCES}, "
                     f"got {source!r}")
  style = shell_tools.check_style(config.harness.style)
  system_prompt = shell_tools.SYSTEM_PROMPT if style == "shell" and source == "generated" else ""
  envs_dict = config.envs.to_dict()
  root = os.path.abspath(worlds_root or config.envs.worlds_root)
  out = []
  for g, task in enumerate(tasks):
    if source == "generated":
      spec = GatewayWorldSpec(task.to_json(), envs_dict, root, work_root,
                              float(config.harness.tool_timeout_s), style)
    else:
      spec = mcp_worlds.world_spec(task, config, root, work_root)
    for k in range(samples_per_task):
      out.append(Episode(task_id=task.id, prompt=task.prompt, world=spec,
                         group_id=first_group + g, sample_index=k,
                         system_prompt=system_prompt,
                         seed=(config.seed * 1_000_003 + (first_group + g) * 1009 + k),
                         meta={"domain": task.domain, "level": task.level,
                               "family": task.family,
                               "world_id": mcp_worlds.world_key(task)}))
  return out
