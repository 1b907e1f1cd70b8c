"""Worlds that show only some tools, and the compact tool schema."""
import dataclasses

import pytest

from envs.harness import tool_subset


class _World:
  def tools(self):
    return [{"type": "function", "function": {"name": n}} for n in ("a", "b", "c")]

  def call_tool(self, name, arguments):
    return (name, arguments)

  def grade(self, answer):
    return answer

  def close(self, reuse=False):
    self.closed = reuse


@dataclasses.dataclass(frozen=True)
class _Spec:
  def start(self):
    return _World()


def test_tool_subset_shows_only_the_named_tools():
  w = tool_subset.ToolSubsetSpec(_Spec(), ("a", "c")).start()
  assert [t["function"]["name"] for t in w.tools()] == ["a", "c"]
  assert w.call_tool("b", {"x": 1}) == ("b", {"x": 1})  # the harness rejects hidden tools
  assert isinstance(tool_subset.ToolSubsetSpec(_Spec(), ()).start(), _World)
  with pytest.raises(ValueError, match="zzz"):
    tool_subset.ToolSubsetSpec(_Spec(), ("a", "zzz")).start().tools()


_READ = {"type": "function", "function": {
    "name": "read", "description": "Read a file.",
    "parameters": {"type": "object", "title": "read_args",
                   "properties": {"path": {"title": "Path", "type": "string"},
                                  "limit": {"title": "Limit", "type": "integer", "default": 5}},
                   "required": ["path"]}}}


def test_compact_tool_schema_keeps_the_name_and_required_typed_parameters():
  assert tool_subset.compact_tool(_READ) == {"type": "function", "function": {
      "name": "read", "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                     "required": ["path"]}}}

  class One(_World):
    def tools(self):
      return [_READ]

  @dataclasses.dataclass(frozen=True)
  class OneSpec:
    def start(self):
      return One()

  w = tool_subset.ToolSubsetSpec(OneSpec(), (), "compact").start()
  assert w.tools() == [tool_subset.compact_tool(_READ)]
  with pytest.raises(ValueError, match="tool_schema"):
    tool_subset.ToolSubsetSpec(OneSpec(), (), "short").start()
