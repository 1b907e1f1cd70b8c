"""Streamed responses of the OpenAI front (rl/rollout/openai_http.py): one choice, sent as
server-sent events token by token while the engine samples it, each event only what extends
the text sent so far (a tail that may still change, an incomplete character or the start of a
stop string or of a tool call, is held back).

`run(job)` is the front's generation (`OpenAIFront._run`): it yields the Sample so far after
each sampled token.
"""
from typing import Sequence

from starlette.responses import StreamingResponse

from rl.rollout.openai_render import VERSION_HEADER
from rl.rollout.openai_render import FUNCTION_TAG
from rl.rollout.openai_render import Renderer
from rl.rollout.openai_render import cut_at_stop
from rl.rollout.openai_render import error_body
from rl.rollout.openai_render import event
from rl.rollout.openai_render import hold_back
from rl.rollout.openai_render import usage
from rl.rollout.openai_requests import ApiError
from rl.rollout.openai_requests import ChatRequest
from rl.rollout.openai_requests import Job
from rl.rollout.openai_requests import get


def one_stream(jobs: Sequence[Job]) -> Job:
  if len(jobs) != 1:
    raise ApiError(400, "'stream' serves one choice: one prompt and n = 1", "stream")
  return jobs[0]


def sse(events, v: int) -> StreamingResponse:
  """Server-sent events; a refusal once the stream has begun (its status line is sent, e.g.
  a full prefill queue) ends it with an error event."""
  async def guarded():
    try:
      async for e in events:
        yield e
    except ApiError as e:
      yield event(error_body(e.status, e.message, e.param, e.kind))
      yield "data: [DONE]\n\n"
  return StreamingResponse(guarded(), media_type="text/event-stream",
                           headers={VERSION_HEADER: str(v), "cache-control": "no-cache"})


def completion_stream(run, render: Renderer, model_name: str, version: int, body: dict, jobs,
                      rid: str, created: int, logprobs, want_ids: bool) -> StreamingResponse:
  """A /v1/completions choice as it is sampled."""
  job = one_stream(jobs)
  with_usage = bool((get(body, "stream_options", dict, {}) or {}).get("include_usage"))

  async def events():
    sent, text_len = 0, 0
    async for s in run(job):
      text = render.text(s, job) if s.finish else render.partial_text(s, job)
      delta, sent = text[sent:], max(sent, len(text))
      new = slice(len(s.ids) - 1, len(s.ids))
      c = {"index": 0, "text": delta, "finish_reason": s.finish or None, "logprobs": None,
           "weights_version": s.version}
      if logprobs is not None:
        c["logprobs"] = render.completion_logprobs(s.ids[new], s.logprobs[new], logprobs,
                                                  text_len)
        text_len += sum(len(t) for t in c["logprobs"]["tokens"])
      if want_ids:
        c["token_ids"] = s.ids[new]
        if len(s.ids) == 1:
          c["prompt_token_ids"] = list(job.prompt)
      yield event({"id": rid, "object": "text_completion", "created": created,
                    "model": model_name, "choices": [c], "weights_version": s.version})
    if with_usage:
      yield event({"id": rid, "object": "text_completion", "created": created,
                    "model": model_name, "choices": [],
                    "usage": usage([job.prompt], [s])})
    yield "data: [DONE]\n\n"
  return sse(events(), version)


def chat_stream(run, render: Renderer, model_name: str, version: int, body: dict,
                req: ChatRequest, rid: str, created: int) -> StreamingResponse:
  """A /v1/chat/completions choice as it is sampled: reasoning and content deltas, then the
  tool calls (or the tool-call error) with the last event."""
  fmt, schemas, keep_special = req.fmt, req.schemas, req.keep_special
  want_lp, want_ids, jobs = req.want_lp, req.want_ids, req.jobs
  job = one_stream(jobs)
  with_usage = bool((get(body, "stream_options", dict, {}) or {}).get("include_usage"))
  head = {"id": rid, "object": "chat.completion.chunk", "created": created,
          "model": model_name}

  def chunk(delta, s, finish=None, extra=None):
    c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None,
         "weights_version": s.version}
    c.update(extra or {})
    return event(dict(head, choices=[c], weights_version=s.version))

  async def events():
    sent = {"reasoning_content": "", "content": ""}
    first = True
    async for s in run(job):
      message, finish = (render.assistant_message(fmt, s, job, schemas, keep_special)
                         if s.finish else ({}, None))
      if s.finish:
        shown = {"reasoning_content": message.get("reasoning_content", ""),
                 "content": message.get("content") or ""}
      else:
        # Text up to the first tool call, less a tail that may still change: an incomplete
        # character, the start of a stop string or of a call written without its tags.
        view = render.turn_view(fmt, render.sampled(s, job), schemas, keep_special,
                               final=False)
        cut = cut_at_stop(view["content"], job.stop_texts)
        visible = view["content"] if cut is None else view["content"][:cut]
        visible = visible[:len(visible) - hold_back(visible, job.stop_texts
                                                     + (FUNCTION_TAG,))]
        reasoning = view["reasoning"]
        shown = {"reasoning_content": reasoning[:len(reasoning) - hold_back(reasoning, ())],
                 "content": visible.lstrip()}
      delta = {"role": "assistant"} if first else {}
      first = False
      for key, text in shown.items():
        # Only what extends the text sent so far (the final text is stripped).
        if text.startswith(sent[key]) and len(text) > len(sent[key]):
          delta[key], sent[key] = text[len(sent[key]):], text
      if message.get("tool_calls"):
        delta["tool_calls"] = [dict(c, index=k) for k, c in enumerate(message["tool_calls"])]
      if "tool_call_error" in message:
        delta["tool_call_error"] = message["tool_call_error"]
      extra = {}
      if want_lp:
        extra["logprobs"] = {"content": render.chat_logprobs(s.ids[-1:], s.logprobs[-1:])}
      if want_ids:
        extra["token_ids"] = s.ids[-1:]
      if delta or extra or s.finish:
        yield chunk(delta, s, finish, extra)
    if with_usage:
      yield event(dict(head, choices=[], usage=usage([job.prompt], [s])))
    yield "data: [DONE]\n\n"
  return sse(events(), version)
