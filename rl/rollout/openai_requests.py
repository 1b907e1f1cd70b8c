"""Reading the OpenAI front's requests (rl/rollout/openai_http.py): typed fields, fields the
server does not support, chat messages and tools, and the settings every request shares
(sampling, stops, choices, prompts) into the engine `Job`s a request asks for. Every refusal is
an `ApiError`: a 4xx with an OpenAI-style error body.
"""
import dataclasses
import json
from typing import Optional, Sequence

from envs.chat import ChatFormat
from rl.rollout.engine import SamplingSettings
from rl.rollout.engine_programs import TOP_LOGPROBS

MAX_CHOICES = 128  # n per request
_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF


class ApiError(Exception):
  """A request the front refuses: answered with `status` and an OpenAI-style error body."""

  def __init__(self, status: int, message: str, param: Optional[str] = None,
               kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.kind = status, message, param, kind


_REQUIRED = object()
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
               list: "a list", dict: "an object"}


def get(body: dict, name: str, kind, default=_REQUIRED, lo=None, hi=None):
  """body[name] checked against `kind` (int, float, bool, str, list, dict) and [lo, hi]; a
  missing or null field is `default` (an error when there is none)."""
  v = body.get(name)
  if v is None:
    if default is _REQUIRED:
      raise ApiError(400, f"'{name}' is required", name)
    return default
  ok = isinstance(v, kind) and not (isinstance(v, bool) and kind is not bool)
  if kind is float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
  if not ok:
    raise ApiError(400, f"'{name}' must be {_TYPE_NAMES[kind]}, got {json.dumps(v)[:80]}", name)
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    bounds = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
    raise ApiError(400, f"'{name}' must be {bounds}, got {v}", name)
  return float(v) if kind is float else v


def refuse(body: dict, unsupported: dict) -> None:
  """400 for a field set to something the server does not do; {name: accepted(value)}."""
  for name, accepted in unsupported.items():
    if body.get(name) is not None and not accepted(body[name]):
      raise ApiError(400, f"'{name}'={json.dumps(body[name])[:80]} is not supported by this "
                     "server (docs/openai_endpoint.md, 'Not supported')", name)


_COMMON_UNSUPPORTED = {
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "min_tokens": lambda v: v == 0,
    "use_beam_search": lambda v: not v,
}
COMPLETION_UNSUPPORTED = dict(_COMMON_UNSUPPORTED, **{
    "suffix": lambda v: not v, "best_of": lambda v: v == 1})
CHAT_UNSUPPORTED = dict(_COMMON_UNSUPPORTED, **{
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
    "top_logprobs": lambda v: v == 0,
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: not v, "prediction": lambda v: not v})


def _content_text(content, where: str) -> str:
  """A message's content: a string or a list of text parts."""
  if content is None or isinstance(content, str):
    return content or ""
  if isinstance(content, list):
    parts = []
    for p in content:
      if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
        raise ApiError(400, f"{where}: only text content parts are supported", "messages")
      parts.append(p["text"])
    return "".join(parts)
  raise ApiError(400, f"{where} must be a string or a list of text parts", "messages")


def _history_call(call, where: str) -> dict:
  """An assistant message's OpenAI tool call -> the template's {"name", "arguments"}."""
  fn = call.get("function") if isinstance(call, dict) else None
  if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
    raise ApiError(400, f"{where} must be {{'type': 'function', 'function': {{'name', "
                   "'arguments'}}}", "messages")
  args = fn.get("arguments") or {}
  if isinstance(args, str):
    try:
      args = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError as e:
      raise ApiError(400, f"{where}.function.arguments is not JSON: {e}", "messages") from None
  if not isinstance(args, dict):
    raise ApiError(400, f"{where}.function.arguments must be a JSON object", "messages")
  return {"name": fn["name"], "arguments": args}


def chat_messages(raw) -> list:
  """OpenAI chat messages -> the messages `envs.chat.template.render_text` reads."""
  if not isinstance(raw, list) or not raw:
    raise ApiError(400, "'messages' must be a non-empty list", "messages")
  out = []
  for i, m in enumerate(raw):
    where = f"messages[{i}]"
    if not isinstance(m, dict):
      raise ApiError(400, f"{where} must be an object", "messages")
    role = {"developer": "system"}.get(m.get("role"), m.get("role"))
    if role not in ("system", "user", "assistant", "tool"):
      raise ApiError(400, f"{where}.role must be system, developer, user, assistant or tool, "
                     f"got {m.get('role')!r}", "messages")
    msg = {"role": role, "content": _content_text(m.get("content"), f"{where}.content")}
    if role == "assistant":
      reasoning = m.get("reasoning_content", m.get("reasoning"))
      if isinstance(reasoning, str):
        msg["reasoning_content"] = reasoning
      calls = m.get("tool_calls") or []
      if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls must be a list", "messages")
      msg["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]")
                           for j, c in enumerate(calls)]
    out.append(msg)
  return out


def chat_tools(raw) -> list:
  """The request's tools (OpenAI function tools), checked; rendered into the system turn as
  given, as the harness renders the world's tools."""
  if raw is None:
    return []
  if not isinstance(raw, list):
    raise ApiError(400, "'tools' must be a list", "tools")
  for i, t in enumerate(raw):
    fn = t.get("function") if isinstance(t, dict) else None
    if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(
        fn.get("name"), str):
      raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name', "
                     "'parameters', ...}}}", "tools")
  return raw


@dataclasses.dataclass
class Job:
  """One engine request: prompt ids, budget, sampling, stop ids and stop strings."""
  prompt: list
  max_tokens: int
  sampling: SamplingSettings
  stop_ids: tuple
  stop_texts: tuple = ()


# -- the settings every request shares ----------------------------------------------------------

def sampling(body: dict, defaults: SamplingSettings) -> SamplingSettings:
  """temperature, top_p, top_k (-1 = off) and seed, each the engine's default when not given."""
  top_k = get(body, "top_k", int, defaults.top_k, lo=-1)
  return SamplingSettings(temperature=get(body, "temperature", float, defaults.temperature, lo=0),
                          top_p=get(body, "top_p", float, defaults.top_p),
                          top_k=0 if top_k == -1 else top_k,
                          seed=get(body, "seed", int, None))


def stops(body: dict, default_ids: Sequence[int], tok) -> tuple:
  """(stop ids, stop strings): the default stop ids (none with vLLM's `ignore_eos`) plus
  `stop_token_ids`, and `stop` strings; a stop string that is one token is also a stop id."""
  ids = [] if get(body, "ignore_eos", bool, False) else [int(i) for i in default_ids]
  extra = get(body, "stop_token_ids", list, [])
  if not all(isinstance(i, int) and not isinstance(i, bool) for i in extra):
    raise ApiError(400, "'stop_token_ids' must be a list of integers", "stop_token_ids")
  ids += extra
  stop = body.get("stop")
  texts = [stop] if isinstance(stop, str) else stop or []
  if not isinstance(texts, list) or not all(isinstance(s, str) and s for s in texts):
    raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
  for s in texts:
    one = tok.encode(s)
    if len(one) == 1 and tok.decode(one) == s:
      ids.append(one[0])
  return tuple(dict.fromkeys(ids)), tuple(texts)


def choices(body: dict) -> int:
  return get(body, "n", int, 1, lo=1, hi=MAX_CHOICES)


def seeded(s: SamplingSettings, i: int) -> SamplingSettings:
  """The i-th choice's sampling: seed + i (each choice its own draw, reproducible)."""
  return s if s.seed is None or i == 0 else dataclasses.replace(s, seed=(s.seed + i) & _SEED_MASK)


# -- /v1/completions ----------------------------------------------------------------------------

def prompts(raw, tok) -> list:
  """`prompt`: a string, a list of token ids, or a list of strings / of token-id lists."""
  is_ids = lambda x: isinstance(x, list) and all(
      isinstance(i, int) and not isinstance(i, bool) for i in x)
  if isinstance(raw, str):
    return [tok.encode(raw)]
  if isinstance(raw, list) and raw:
    if is_ids(raw):
      return [list(raw)]
    if all(isinstance(x, str) for x in raw):
      return [tok.encode(x) for x in raw]
    if all(is_ids(x) for x in raw):
      return [list(x) for x in raw]
  raise ApiError(400, "'prompt' must be a string, a list of token ids, or a non-empty list "
                 "of strings or of token-id lists", "prompt")


def logprobs_wanted(body: dict, echo: bool, max_tokens: int) -> Optional[int]:
  """`logprobs` of a completion request: 0 or 1 (the sampled token's logprob; the engine
  computes no alternatives for sampled tokens), and with `echo` up to TOP_LOGPROBS
  alternatives for the prompt's tokens when nothing is sampled (max_tokens = 0)."""
  logprobs = get(body, "logprobs", int, None, lo=0, hi=TOP_LOGPROBS if echo else None)
  if logprobs is not None and logprobs > 1 and not (echo and max_tokens == 0):
    raise ApiError(400, f"'logprobs'={logprobs} is not supported here: the engine computes the "
                   "sampled token's logprob only (logprobs 0 or 1); alternatives up to "
                   f"{TOP_LOGPROBS} are served for the prompt's tokens, with echo=true and "
                   "max_tokens=0 (docs/openai_endpoint.md)", "logprobs")
  return logprobs


@dataclasses.dataclass
class CompletionRequest:
  """A /v1/completions request read: its prompts' ids and one Job per prompt and choice."""
  prompts: list
  n: int
  echo: bool
  logprobs: Optional[int]
  want_ids: bool
  jobs: list


def completion_request(body: dict, tok, default_sampling: SamplingSettings,
                       default_stop_ids: Sequence[int]) -> CompletionRequest:
  refuse(body, COMPLETION_UNSUPPORTED)
  ids = prompts(body.get("prompt"), tok)
  n = choices(body)
  echo = get(body, "echo", bool, False)
  max_tokens = get(body, "max_tokens", int, 16, lo=0 if echo else 1)
  logprobs = logprobs_wanted(body, echo, max_tokens)
  want_ids = get(body, "return_token_ids", bool, False)
  settings = sampling(body, default_sampling)
  stop_ids, stop_texts = stops(body, default_stop_ids, tok)
  jobs = [Job(p, max_tokens, seeded(settings, i), stop_ids, stop_texts)
          for p in ids for i in range(n)]
  return CompletionRequest(ids, n, echo, logprobs, want_ids, jobs)


# -- /v1/chat/completions -----------------------------------------------------------------------

@dataclasses.dataclass
class ChatRequest:
  """A /v1/chat/completions request read: the chat format, the rendered prompt, one Job per
  choice, the tools' parameter schemas (None under tool_choice "none") and the options."""
  fmt: ChatFormat
  prompt: list
  jobs: list
  schemas: Optional[dict]
  want_lp: bool
  want_ids: bool
  keep_special: bool


def chat_format(body: dict, formats: dict, thinking: bool) -> ChatFormat:
  """The chat format of `chat_template_kwargs.enable_thinking` (default `thinking`)."""
  kwargs = get(body, "chat_template_kwargs", dict, {})
  thinking = kwargs.get("enable_thinking", thinking)
  if not isinstance(thinking, bool):
    raise ApiError(400, "'chat_template_kwargs.enable_thinking' must be a boolean",
                   "chat_template_kwargs")
  return formats[thinking]


def chat_request(body: dict, tok, formats: dict, thinking: bool,
                 default_sampling: SamplingSettings, max_len: int) -> ChatRequest:
  refuse(body, CHAT_UNSUPPORTED)
  messages, tools = chat_messages(body.get("messages")), chat_tools(body.get("tools"))
  choice = body.get("tool_choice", "auto")
  if choice not in ("auto", "none"):
    raise ApiError(400, "'tool_choice' may be 'auto' or 'none' (a required or named tool "
                   "is not supported)", "tool_choice")
  fmt = chat_format(body, formats, thinking)
  try:
    prompt = fmt.render_ids(messages, tools)
  except (ValueError, KeyError, TypeError) as e:
    raise ApiError(400, f"messages cannot be rendered: {e}", "messages") from None
  budget = max_len - len(prompt)
  max_tokens = get(body, "max_completion_tokens", int, None, lo=1) or get(
      body, "max_tokens", int, max(budget, 1), lo=1)
  want_lp = get(body, "logprobs", bool, False)
  want_ids = get(body, "return_token_ids", bool, False)
  keep_special = not get(body, "skip_special_tokens", bool, True)
  stop_ids, stop_texts = stops(body, fmt.stop_ids, tok)
  settings = sampling(body, default_sampling)
  jobs = [Job(prompt, max_tokens, seeded(settings, i), stop_ids, stop_texts)
          for i in range(choices(body))]
  schemas = ({t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
             if choice == "auto" else None)
  return ChatRequest(fmt, prompt, jobs, schemas, want_lp, want_ids, keep_special)
