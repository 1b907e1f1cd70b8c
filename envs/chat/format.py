"""The chat format in token ids: prompts, observations and parsed model turns.

Every piece of the conversation that the harness appends is built here from the template
pieces in `envs.chat.template`, with control tokens placed by id. The model's own output is
never re-encoded: `parse` only *reads* sampled ids (decoding the spans between control ids)
to find tool calls and the final answer; the trajectory keeps the ids as sampled.

Each appended piece starts right after a control token and ends right before one, so the
pieces are tokenized at the same boundaries as the whole conversation rendered at once
(`render_ids`); tests check the two agree id for id.
"""
import dataclasses
from typing import Any, Mapping, Sequence

from envs.chat import template
from envs.chat.template import BadToolCall
from envs.chat.tokenizer import Tokenizer


@dataclasses.dataclass
class ToolCall:
  name: str
  arguments: dict[str, Any]


@dataclasses.dataclass
class ParsedTurn:
  """What a sampled assistant turn says.

  Attributes:
    reasoning: the text before `</think>` (empty with thinking off).
    content: the visible text with tool-call blocks removed; the final answer when there are
      no tool calls.
    tool_calls: well-formed calls in order (names not yet checked against the tools).
    error: the first format error, if any; the turn then gets a repair message.
    stopped: the turn ended with a stop id (not cut by max_tokens).
  """
  reasoning: str = ""
  content: str = ""
  tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
  error: BadToolCall | None = None
  stopped: bool = True


class ChatFormat:
  """Builds and reads the Qwen3.5 chat format in ids for one tokenizer.

  Args:
    tokenizer: the tokenizer.
    thinking: generation prompts open a think block for the model to fill (True) or hold an
      empty one (False).
  """

  def __init__(self, tokenizer: Tokenizer, thinking: bool = True):
    self.tok = tokenizer
    self.sp = tokenizer.special
    self.thinking = thinking
    self._nl = tokenizer.encode("\n")
    self._gen_prompt = tokenizer.encode(template.generation_prompt(thinking))
    # Every episode of a world carries the same tool list: its system turn (thousands of
    # tokens) is encoded once. Keyed by the exact text, so a changed schema misses the cache.
    self._system_cache: dict[str, list[int]] = {}

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self.sp.stop_ids

  # -- pieces the harness appends -------------------------------------------------------

  def system_ids(self, tools: Sequence[Mapping[str, Any]], system_prompt: str = "") -> list[int]:
    """The system turn (tools and call-format instructions), `<|im_end|>\\n` included."""
    if tools:
      body = template.tools_system_text(tools, system_prompt)
    elif system_prompt.strip():
      body = system_prompt.strip()
    else:
      return []
    # The template text is ours and holds real control tokens (the call-format example);
    # the system prompt is trusted configuration.
    ids = self._system_cache.get(body)
    if ids is None:
      ids = ([self.sp.im_start] + self.tok.encode("system\n" + body) + [self.sp.im_end]
             + self._nl)
      if len(self._system_cache) >= 64:
        self._system_cache.clear()
      self._system_cache[body] = ids
    return list(ids)

  def user_ids(self, text: str) -> list[int]:
    """A user turn; the text is untrusted (control strings stay plain text)."""
    return ([self.sp.im_start] + self.tok.encode("user\n") + self._text(text.strip())
            + [self.sp.im_end] + self._nl)

  def generation_prompt_ids(self) -> list[int]:
    return list(self._gen_prompt)

  def prompt_ids(self, tools: Sequence[Mapping[str, Any]], user: str,
                 system_prompt: str = "") -> list[int]:
    """System turn + the task as a user turn + the generation prompt."""
    return self.system_ids(tools, system_prompt) + self.user_ids(user) + self._gen_prompt

  def close_turn_ids(self, sampled: Sequence[int]) -> list[int]:
    """What closes an assistant turn after its sampled ids: `\\n`, plus `<|im_end|>` first
    when the sample did not end with a stop id (cut by max_tokens)."""
    if sampled and sampled[-1] in self.stop_ids:
      return list(self._nl)
    return [self.sp.im_end] + self._nl

  def tool_results_ids(self, results: Sequence[str]) -> list[int]:
    """One user turn holding the tool results (untrusted text), `<|im_end|>\\n` included."""
    ids = [self.sp.im_start] + self.tok.encode("user")
    for r in results:
      ids += (self._nl + [self.sp.tool_response] + self._text("\n" + r.strip() + "\n")
              + [self.sp.tool_response_end])
    return ids + [self.sp.im_end] + self._nl

  def observation_ids(self, sampled: Sequence[int], results: Sequence[str]) -> list[int]:
    """Everything between one sampled turn and the next: close, results, generation prompt."""
    return self.close_turn_ids(sampled) + self.tool_results_ids(results) + self._gen_prompt

  def _text(self, text: str) -> list[int]:
    return self.tok.encode(text, allow_control=False)

  # -- reading a sampled turn --------------------------------------------------------------

  def parse(self, sampled: Sequence[int],
            tools: Mapping[str, Mapping[str, Any]] | None = None) -> ParsedTurn:
    """Reads a sampled assistant turn.

    Args:
      sampled: the sampled ids (a trailing stop id is allowed).
      tools: tool name -> JSON schema of its parameters, to type the arguments and check
        required ones; unknown names are left for the caller to judge.
    """
    ids = list(sampled)
    stopped = bool(ids) and ids[-1] in self.stop_ids
    if stopped:
      ids = ids[:-1]
    out = ParsedTurn(stopped=stopped)
    if self.sp.think_end in ids:
      cut = ids.index(self.sp.think_end)
      out.reasoning = self.tok.decode(ids[:cut]).strip()
      ids = ids[cut + 1:]
    # Split the visible part at the tool-call control ids.
    text_parts: list[str] = []
    pos = 0
    while pos < len(ids):
      if ids[pos] == self.sp.tool_call:
        try:
          end = ids.index(self.sp.tool_call_end, pos + 1)
        except ValueError:
          out.error = out.error or BadToolCall("<tool_call> is not closed by </tool_call>",
                                               self.tok.decode(ids[pos:]))
          break
        inner = ids[pos + 1:end]
        if self.sp.tool_call in inner:
          out.error = out.error or BadToolCall("<tool_call> opened twice before </tool_call>",
                                               self.tok.decode(inner))
        else:
          body = self.tok.decode(inner)
          try:
            name, args = template.parse_tool_call_body(body, self._schema(tools, body))
            out.tool_calls.append(ToolCall(name, args))
          except BadToolCall as e:
            out.error = out.error or e
        pos = end + 1
        continue
      nxt = _index_any(ids, (self.sp.tool_call, self.sp.tool_call_end), pos)
      if nxt < len(ids) and ids[nxt] == self.sp.tool_call_end:
        out.error = out.error or BadToolCall("</tool_call> without a matching <tool_call>")
        text_parts.append(self.tok.decode(ids[pos:nxt]))
        pos = nxt + 1
        continue
      text_parts.append(self.tok.decode(ids[pos:nxt]))
      pos = nxt
    out.content = "".join(text_parts).strip()
    if out.error is None and not out.tool_calls and "<function=" in out.content:
      out.error = BadToolCall("a <function=...> block must be nested within "
                              "<tool_call></tool_call> tags", out.content)
    return out

  @staticmethod
  def _schema(tools, body: str):
    if not tools:
      return None
    head = body.split("<function=", 1)[-1].split(">", 1)[0].strip()
    return tools.get(head)

  # -- whole conversations ----------------------------------------------------------------

  def render_ids(self, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Mapping[str, Any]] = (),
                 add_generation_prompt: bool = True) -> list[int]:
    """A whole conversation, rendered as text by the template and encoded at once."""
    return self.tok.encode(
        template.render_text(messages, tools, add_generation_prompt, self.thinking))


def _index_any(ids: Sequence[int], targets: tuple[int, ...], start: int) -> int:
  for i in range(start, len(ids)):
    if ids[i] in targets:
      return i
  return len(ids)
