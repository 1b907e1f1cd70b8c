"""The OpenAI front's responses (rl/rollout/openai_http.py) from what the engine sampled: the
text (a final stop id and stop strings cut), logprobs, the prompt in front for `echo`, usage,
assistant messages with the tool calls the harness's parser reads, and server-sent events.
"""
import dataclasses
import itertools
import json
import uuid
from typing import Any, Optional, Sequence

from envs.chat import ChatFormat
from rl.rollout import orchestrator
from rl.rollout.openai_requests import Job

VERSION_HEADER = "x-weights-version"
# A tool call's opening in the Qwen3.5 format; in text without `<tool_call>` tags it is a call
# the parser refuses (ChatFormat.parse).
FUNCTION_TAG = "<function="


@dataclasses.dataclass
class Sample:
  """What one engine request sampled (ids and logprobs include a final stop id)."""
  ids: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  finish: str = ""
  version: int = 0
  stop_text: bool = False  # ended by one of the request's stop strings


def cut_at_stop(text: str, stops: Sequence[str]) -> Optional[int]:
  hits = [text.find(s) for s in stops if s and s in text]
  return min(hits) if hits else None


def hold_back(text: str, stops: Sequence[str]) -> int:
  """How many trailing characters of `text` may not be sent yet: an incomplete UTF-8 sequence
  (decoded as U+FFFD) or the start of a stop string."""
  n = 0
  while n < len(text) and text[len(text) - 1 - n] == "\ufffd":
    n += 1
  longest = max((len(s) for s in stops), default=0)
  for k in range(min(longest - 1, len(text) - n), 0, -1):
    if any(s.startswith(text[len(text) - n - k:len(text) - n]) for s in stops):
      return n + k
  return n


def usage(prompts, samples) -> dict:
  p = sum(len(x) for x in prompts)
  c = sum(len(s.ids) for s in samples)
  return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def event(obj: Any) -> str:
  """One server-sent event."""
  return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def error_body(status: int, message: str, param=None, kind="invalid_request_error") -> dict:
  """An OpenAI-style error body."""
  return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class Renderer:
  """Texts, logprobs and messages of samples, with the served tokenizer.

  Args:
    tok: the chat tokenizer.
  """

  def __init__(self, tok):
    self.tok = tok
    self._control_ids = frozenset(tok.added_tokens())

  @staticmethod
  def sampled(sample: Sample, job: Job) -> list:
    """The sampled ids without a final stop id (which ends the text, not part of it)."""
    ids = sample.ids
    if ids and sample.finish == orchestrator.FINISH_STOP and ids[-1] in job.stop_ids:
      return ids[:-1]
    return list(ids)

  def text(self, sample: Sample, job: Job) -> str:
    """The sampled text: a final stop id left out, cut before the first stop string."""
    text = self.tok.decode(self.sampled(sample, job))
    cut = cut_at_stop(text, job.stop_texts)
    return text if cut is None else text[:cut]

  def partial_text(self, s: Sample, job: Job) -> str:
    """The text of an unfinished sample that may be sent: without a tail that could still
    change (an incomplete character) or turn out to be a stop string."""
    text = self.tok.decode(s.ids)
    return text[:len(text) - hold_back(text, job.stop_texts)]

  def token_strings(self, ids: Sequence[int]) -> list:
    return [self.tok.decode([int(i)]) for i in ids]

  # -- completions ----------------------------------------------------------------------------

  def completion_logprobs(self, ids, logprobs, top: int, offset: int) -> dict:
    tokens = self.token_strings(ids)
    offsets = []
    for t in tokens:
      offsets.append(offset)
      offset += len(t)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logprobs],
            "top_logprobs": [{t: float(x)} for t, x in zip(tokens, logprobs)] if top else None,
            "text_offset": offsets}

  def echo(self, choice: dict, job: Job, scores, top: Optional[int]) -> None:
    """Puts the prompt in front of a completion choice, as echo asks: its text, and with
    logprobs its tokens' logprobs (the first None: it has no context, as vLLM and OpenAI
    answer) and, with `top` >= 1, the `top` likeliest tokens at each position plus the prompt's
    own. The prompt's logprobs are the model's (temperature 1), from `engine.score`."""
    prompt_text = self.tok.decode(job.prompt)
    choice["text"] = prompt_text + choice["text"]
    choice["weights_version"] = max(choice["weights_version"], scores.version)
    if top is None:
      return
    tokens = self.token_strings(job.prompt)
    lps = [None] + [float(x) for x in scores.logprobs[1:]]
    tops = None
    if top:
      tops = [None]
      for i in range(1, len(job.prompt)):
        alts = {}
        for t, x in [(tokens[i], scores.logprobs[i])] + list(zip(
            self.token_strings(scores.top_ids[i, :top]), scores.top_logprobs[i, :top])):
          alts[t] = max(float(x), alts.get(t, -float("inf")))  # two ids may print alike
        tops.append(alts)
    sampled = choice["logprobs"]
    offsets = list(itertools.accumulate([0] + [len(t) for t in tokens]))
    choice["logprobs"] = {
        "tokens": tokens + sampled["tokens"],
        "token_logprobs": lps + sampled["token_logprobs"],
        "top_logprobs": None if tops is None else tops + sampled["top_logprobs"],
        "text_offset": offsets[:-1] + [offsets[-1] + o for o in sampled["text_offset"]]}

  # -- chat ---------------------------------------------------------------------------------

  def chat_logprobs(self, ids, logprobs) -> list:
    return [{"token": t, "logprob": float(x), "bytes": list(t.encode("utf-8")),
             "top_logprobs": []} for t, x in zip(self.token_strings(ids), logprobs)]

  def decode(self, ids: Sequence[int], keep_special: bool) -> str:
    """Text of `ids`; without `keep_special` the control tokens (`<|im_start|>`, `<tool_call>`,
    ...) are left out, as vLLM's `skip_special_tokens` does by default."""
    if not keep_special:
      ids = [i for i in ids if i not in self._control_ids]
    return self.tok.decode(ids)

  def turn_view(self, fmt: ChatFormat, ids: Sequence[int], schemas, keep_special: bool,
                 final: bool) -> dict:
    """What a sampled assistant turn (ids without their stop id) shows a client: reasoning,
    content, tool calls and a tool-call error. A tool call's text is never content: a call the
    parser (ChatFormat.parse, the harness's) reads is returned in `calls`; one it cannot read,
    or any call under tool_choice "none" (`schemas` None), is reported in `error` ({"message":
    why, "text": the call as sampled}) and the content ends before it. Unfinished (`final`
    False), the content ends before the first call, which may still be forming."""
    ids = list(ids)
    reasoning: list = []
    if fmt.sp.think_end in ids:
      cut = ids.index(fmt.sp.think_end)
      reasoning, ids = ids[:cut], ids[cut + 1:]
    elif fmt.thinking:
      reasoning, ids = ids, []   # the think block is still open: all of it is reasoning
    markers = (fmt.sp.tool_call, fmt.sp.tool_call_end)
    first = next((k for k, i in enumerate(ids) if i in markers), len(ids))
    head = self.decode(ids[:first], keep_special)
    bare = head.find(FUNCTION_TAG)   # a call written without its <tool_call> tags
    view = {"reasoning": self.decode(reasoning, keep_special).strip(),
            "content": head if bare < 0 else head[:bare], "calls": [], "error": None}
    if first == len(ids) and bare < 0:
      view["content"] = view["content"].strip()
      return view
    if not final:
      return view
    raw = (head[bare:] if bare >= 0 else "") + self.tok.decode(ids[first:])
    if schemas is None:
      view["error"] = {"message": "the turn holds a tool call, not parsed: tool_choice is "
                                  "'none'", "text": raw.strip()}
    else:
      turn = fmt.parse(ids, schemas)
      if turn.error is None:
        outside, inside = [], False
        for i in ids:
          if i in markers:
            inside = i == fmt.sp.tool_call
          elif not inside:
            outside.append(i)
        view["content"] = self.decode(outside, keep_special)
        view["calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": c.name, "arguments": json.dumps(
                              c.arguments, ensure_ascii=False)}} for c in turn.tool_calls]
      else:
        view["error"] = {"message": turn.error.reason, "text": raw.strip()}
    view["content"] = view["content"].strip()
    return view

  def assistant_message(self, fmt: ChatFormat, s: Sample, job: Job, schemas,
                         keep_special: bool) -> tuple:
    """(message, finish_reason) of a sampled turn: reasoning, content and the tool calls the
    harness's parser reads in it, or `tool_call_error` for a call it cannot read (the content
    then ends before the call; `turn_view`)."""
    view = self.turn_view(fmt, self.sampled(s, job), schemas, keep_special, final=True)
    content, calls = view["content"], view["calls"]
    cut = cut_at_stop(content, job.stop_texts)
    content = content if cut is None else content[:cut]
    message = {"role": "assistant", "content": content or (None if calls else "")}
    if view["reasoning"]:
      message["reasoning_content"] = view["reasoning"]
    if calls:
      message["tool_calls"] = calls
    if view["error"]:
      message["tool_call_error"] = view["error"]
    finish = "tool_calls" if calls and s.finish == orchestrator.FINISH_STOP else s.finish
    return message, finish
