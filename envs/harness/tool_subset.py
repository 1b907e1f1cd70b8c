"""Worlds that show the policy only some of their tools (config.loop.tools, loop.tool_schema).

The small setups have no use for most of the 24 tools, and each one costs a few hundred tokens of
system prompt in every trajectory. `ToolSubsetSpec` wraps any world spec of the harness; the
world it starts lists only the named tools (a call to a hidden one is an unknown-tool error like
any other) and, with schema "compact", each tool's JSON cut to its name and required parameters.

The tools follow the world's style (config.harness.style): a world of the shell style serves
bash, read, write, edit, glob and grep, and `loop.tools` names of the app tools (the MCP style)
do not apply to it, nor shell names to an MCP world. A list that names only tools of the other
style shows the world's tools whole.
"""
import dataclasses
from typing import Any

from envs.apps import shell_tools


@dataclasses.dataclass(frozen=True)
class ToolSubsetSpec:
  """A world spec whose started world shows only `tools` (all when empty).

  The small setups have no use for most of the 24 tools, and each one costs a few hundred
  tokens of system prompt in every trajectory; a call to a hidden tool is an unknown-tool
  error like any other. `schema="compact"` also shortens each tool's JSON to its name and
  required parameters with their types (see `compact_tool`). Picklable, so it travels to the
  agent processes.
  """
  inner: Any
  tools: tuple = ()
  schema: str = "full"

  def start(self):
    world = self.inner.start()
    if not self.tools and self.schema == "full":
      return world
    return ToolSubsetWorld(world, self.tools, self.schema)


TOOL_SCHEMAS = ("full", "compact")


def compact_tool(tool: dict) -> dict:
  """A tool's JSON cut to what a call needs: name, required parameters and their types.

  Descriptions, titles, defaults and optional parameters go: for a model trained on the
  environment's own demonstrations they are ~100 tokens a tool of fixed text in every
  trajectory. The result is still a valid function schema of the same call format.
  """
  fn = tool.get("function", tool)
  params = fn.get("parameters") or {}
  required = list(params.get("required") or [])
  props = params.get("properties") or {}
  return {"type": "function", "function": {
      "name": fn["name"],
      "parameters": {"type": "object",
                     "properties": {k: {"type": props.get(k, {}).get("type", "string")}
                                    for k in required},
                     "required": required}}}


class ToolSubsetWorld:
  """A started world seen through `ToolSubsetSpec`: its tools filtered (and compacted)."""


  def __init__(self, world, names, schema: str = "full"):
    if schema not in TOOL_SCHEMAS:
      raise ValueError(f"config.loop.tool_schema={schema!r}; expected one of {TOOL_SCHEMAS}")
    self._w, self._names, self._schema = world, set(names), schema

  def tools(self):
    out = self._w.tools()
    names = _names_for_style(self._names, getattr(self._w, "style", None))
    if names:
      out = [t for t in out if t.get("function", t)["name"] in names]
      missing = names - {t.get("function", t)["name"] for t in out}
      if missing:
        raise ValueError(f"config.loop.tools names tools this world does not have: "
                         f"{sorted(missing)}")
    return [compact_tool(t) for t in out] if self._schema == "compact" else out

  def call_tool(self, name, arguments):
    return self._w.call_tool(name, arguments)

  def grade(self, final_answer):
    return self._w.grade(final_answer)

  def close(self, reuse: bool = False):
    return self._w.close(reuse=reuse)


def _names_for_style(names: set, style: str | None) -> set:
  """The names of `names` that apply to a world of `style` (None: a world of no style, e.g. a
  test's: all of them). Names of the other style's tools are left out."""
  if style is None:
    return set(names)
  other = {n for s in shell_tools.STYLES if s != style for n in shell_tools.tool_names(s)}
  return set(names) - (other - set(shell_tools.tool_names(style)))
