"""The Qwen3.5 chat template as text: the strings of every piece, and the tool-call grammar.

This mirrors the Jinja chat template shipped with Qwen3.5 (and Qwen3-Coder's tool format):

  <|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>
  {one JSON line per tool}\n</tools>\n\n{call-format instructions}[\n\n{system prompt}]<|im_end|>\n
  <|im_start|>user\n{prompt}<|im_end|>\n
  <|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{content}[\n\n]<tool_call>\n
  <function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n
  <|im_start|>user\n<tool_response>\n{result}\n</tool_response>\n<tool_response>...<|im_end|>\n
  <|im_start|>assistant\n<think>\n                      (generation prompt, thinking on)
  <|im_start|>assistant\n<think>\n\n</think>\n\n        (generation prompt, thinking off)

Past reasoning is kept in the context, so the conversation only ever grows at its end: that
is what makes token-in/token-out append-only. (The published template drops the think blocks of
assistant turns before the last user query; within one task, as in every agent episode here,
the two render the same ids. tests/envs/test_chat_template_hf.py checks this, and
docs/hf_export.md lists every difference.) Token ids are built from these pieces in
`envs.chat.format`; this module is text only.
"""
import json
import re
from typing import Any, Mapping, Sequence

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
THINK = "<think>"
THINK_END = "</think>"

TOOLS_HEADER = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_FOOTER = "\n</tools>"
# Fixed call-format instructions, verbatim from the Qwen3.5 / Qwen3-Coder template.
CALL_FORMAT_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:"
    "\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is "
    "no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>")


class BadToolCall(ValueError):
  """A tool call the model wrote does not follow the format; `reason` goes into the repair."""

  def __init__(self, reason: str, text: str = ""):
    super().__init__(reason)
    self.reason = reason
    self.text = text


def tojson(value: Any) -> str:
  """The template's `tojson` filter (Hugging Face: ensure_ascii off, default separators)."""
  return json.dumps(value, ensure_ascii=False)


def tools_system_text(tools: Sequence[Mapping[str, Any]], system_prompt: str = "") -> str:
  """Body of the system turn when tools are offered (between `system\\n` and `<|im_end|>`)."""
  text = TOOLS_HEADER + "".join("\n" + tojson(t) for t in tools) + TOOLS_FOOTER
  text += CALL_FORMAT_INSTRUCTIONS
  if system_prompt.strip():
    text += "\n\n" + system_prompt.strip()
  return text


def format_arguments(arguments: Mapping[str, Any] | str) -> str:
  """`<parameter=ARG>\\nVALUE\\n</parameter>\\n` per argument: strings raw, the rest JSON.
  `arguments` may be a JSON object as a string (the OpenAI wire form): read as that mapping."""
  if isinstance(arguments, str):
    arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
      raise ValueError("tool-call arguments must be a JSON object, got "
                       f"{type(arguments).__name__}")
  out = []
  for name, value in arguments.items():
    value = value if isinstance(value, str) else tojson(value)
    out.append(f"<parameter={name}>\n{value}\n</parameter>\n")
  return "".join(out)


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
  """One call, `<tool_call>` ... `</tool_call>` included."""
  return (f"{TOOL_CALL}\n<function={name}>\n{format_arguments(arguments)}</function>\n"
          f"{TOOL_CALL_END}")


def assistant_text(content: str = "", tool_calls: Sequence[Mapping[str, Any]] = (),
                   reasoning: str | None = "") -> str:
  """What the model writes after the generation prompt, `<|im_end|>` excluded.

  Args:
    content: the visible answer (trimmed, as the template does).
    tool_calls: `{"name", "arguments"}` dicts, or OpenAI's `{"function": {"name",
      "arguments"}}`; arguments a mapping or a JSON object as a string.
    reasoning: the thinking text; None when the turn was generated with thinking off (the
      prompt then already holds the empty think block).
  """
  content = content.strip()
  text = ""
  if reasoning is not None:
    text += reasoning.strip() + "\n" + THINK_END + "\n\n"
  text += content
  for i, call in enumerate(tool_calls):
    call = call.get("function", call)
    sep = ("\n\n" if content else "") if i == 0 else "\n"
    text += sep + format_tool_call(call["name"], call.get("arguments") or {})
  return text


def generation_prompt(thinking: bool) -> str:
  return f"{IM_START}assistant\n{THINK}\n" + ("" if thinking else f"\n{THINK_END}\n\n")


def tool_responses_text(results: Sequence[str]) -> str:
  """The user turn that carries tool results, `<|im_end|>\\n` included."""
  body = "".join(f"\n{TOOL_RESPONSE}\n{r}\n{TOOL_RESPONSE_END}" for r in results)
  return f"{IM_START}user{body}{IM_END}\n"


def render_text(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
                add_generation_prompt: bool = True, thinking: bool = True) -> str:
  """A whole conversation as the chat template renders it.

  Messages are dicts with `role` (system, user, assistant, tool) and `content`; assistant
  messages may carry `reasoning_content` and `tool_calls` (`{"name", "arguments"}`).
  Consecutive tool messages share one user turn.
  """
  if not messages:
    raise ValueError("no messages")
  out = []
  first = 0
  system_prompt = ""
  if messages[0]["role"] == "system":
    system_prompt = messages[0].get("content") or ""
    first = 1
  if tools:
    out.append(f"{IM_START}system\n{tools_system_text(tools, system_prompt)}{IM_END}\n")
  elif system_prompt.strip():
    out.append(f"{IM_START}system\n{system_prompt.strip()}{IM_END}\n")
  pending_results: list[str] = []
  for msg in messages[first:]:
    role = msg["role"]
    if role != "tool" and pending_results:
      out.append(tool_responses_text(pending_results))
      pending_results = []
    if role == "system":
      raise ValueError("a system message must come first")
    if role == "user":
      out.append(f"{IM_START}user\n{(msg.get('content') or '').strip()}{IM_END}\n")
    elif role == "assistant":
      reasoning = msg.get("reasoning_content") or ""
      body = THINK + "\n" + assistant_text(msg.get("content") or "", msg.get("tool_calls") or (),
                                           reasoning)
      out.append(f"{IM_START}assistant\n{body}{IM_END}\n")
    elif role == "tool":
      pending_results.append((msg.get("content") or "").strip())
    else:
      raise ValueError(f"unexpected message role {role!r}")
  if pending_results:
    out.append(tool_responses_text(pending_results))
  if add_generation_prompt:
    out.append(generation_prompt(thinking))
  return "".join(out)


_FUNCTION_RE = re.compile(r"^\s*<function=([^>\n]*)>\n?(.*?)</function>\s*$", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>\s*", re.DOTALL)


def parse_tool_call_body(text: str, schema: Mapping[str, Any] | None = None
                         ) -> tuple[str, dict[str, Any]]:
  """Parses the text between `<tool_call>` and `</tool_call>`.

  Args:
    text: the decoded body.
    schema: the tool's JSON schema (`parameters`) when known; string-typed parameters are
      then kept verbatim and the others JSON-decoded.

  Returns:
    (name, arguments).

  Raises:
    BadToolCall: the body is not one `<function=NAME>` block of `<parameter=ARG>` blocks.
  """
  m = _FUNCTION_RE.match(text)
  if not m:
    if "<function=" not in text:
      raise BadToolCall("no <function=NAME> block inside <tool_call></tool_call>", text)
    if "</function>" not in text:
      raise BadToolCall("<function=...> is not closed by </function>", text)
    raise BadToolCall("text outside the <function=...></function> block", text)
  name, body = m.group(1).strip(), m.group(2)
  if not name:
    raise BadToolCall("empty function name", text)
  props = ((schema or {}).get("properties") or {})
  args: dict[str, Any] = {}
  pos = 0
  for pm in _PARAM_RE.finditer(body):
    if body[pos:pm.start()].strip():
      raise BadToolCall(f"unexpected text in <function={name}>: {body[pos:pm.start()].strip()[:80]!r}",
                        text)
    pos = pm.end()
    arg, raw = pm.group(1).strip(), pm.group(2)
    if not arg:
      raise BadToolCall("empty parameter name", text)
    if arg in args:
      raise BadToolCall(f"parameter {arg!r} given twice", text)
    args[arg] = _convert(raw, (props.get(arg) or {}).get("type"))
  rest = body[pos:]
  if rest.strip():
    if "<parameter=" in rest:
      raise BadToolCall("<parameter=...> is not closed by </parameter>", text)
    raise BadToolCall(f"unexpected text in <function={name}>: {rest.strip()[:80]!r}", text)
  missing = [r for r in ((schema or {}).get("required") or ()) if r not in args]
  if missing:
    raise BadToolCall(f"missing required parameter(s) {', '.join(missing)} of {name}", text)
  return name, args


def _convert(raw: str, json_type: Any) -> Any:
  # Strings stay verbatim (a "007" account number must not become 7); everything else is the
  # JSON the template wrote, falling back to the raw text when it does not parse.
  if json_type == "string" or (isinstance(json_type, list) and "string" in json_type):
    return raw
  try:
    return json.loads(raw)
  except (json.JSONDecodeError, ValueError):
    return raw
