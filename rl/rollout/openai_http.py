"""An OpenAI-compatible HTTP front for the rollout server, beside its gRPC port.

    server = serve.build_server(config)                     # the gRPC RolloutServer
    front = OpenAIFront(server, config, port=8000).start()  # http://host:8000/v1
    ...
    front.stop(); server.stop()

`python launch.py --mode=serve --config=... --port=9000 --http_port=8000` runs both. Endpoints
(docs/openai_endpoint.md has what each accepts and returns):

  POST /v1/completions       prompt as text or token ids (or a list of either); `logprobs`,
                             and vLLM's `return_token_ids` extension for the sampled ids
  POST /v1/chat/completions  messages rendered with the project's chat format (envs/chat), tool
                             calls in the sampled turn parsed into `tool_calls` by the parser
                             the harness uses (ChatFormat.parse)
  GET  /v1/models, GET /health

Requests from HTTP and gRPC clients meet in one JetStream prefill queue and share the engine's
decode slots: an HTTP request is validated by the same `orchestrator.build_request`, placed on
the driver's queue and read back token by token (id, logprob, finish, weights version) from the
same detokenize thread. Sampling is the engine's: the same request with the same seed samples
the same ids and logprobs over either front. Every response carries the weights version that
sampled it (`weights_version`, header `x-weights-version`). A refused request gets a 4xx with an
OpenAI-style error body; the server keeps serving. A client that goes away frees its slot at
the next step, as over gRPC.

The server runs uvicorn (Starlette) on its own thread and event loop.
"""
import asyncio
import dataclasses
import itertools
import json
import logging
import queue
import socket
import threading
import time
import uuid
from concurrent import futures
from typing import Any, Optional, Sequence

from jetstream.core.utils import async_multifuture
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.responses import Response
from starlette.responses import StreamingResponse
from starlette.routing import Route
import uvicorn

from envs import version
from envs.chat import ChatFormat
from envs.chat import tokenizer as chat_tokenizer
from rl.rollout import orchestrator
from rl.rollout.engine import SamplingSettings
from rl.rollout.engine import TOP_LOGPROBS

VERSION_HEADER = "x-weights-version"
MAX_CHOICES = 128  # n per request
_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF
# The error type of a request the server ends unanswered (or refuses) because it is stopping:
# HTTP 503, or a stream's last event before [DONE].
SHUTTING_DOWN = "server_shutting_down"
# A tool call's opening in the Qwen3.5 format; in text without `<tool_call>` tags it is a call
# the parser refuses (ChatFormat.parse).
_FUNCTION_TAG = "<function="


class ApiError(Exception):
  """A request the front refuses: answered with `status` and an OpenAI-style error body."""

  def __init__(self, status: int, message: str, param: Optional[str] = None,
               kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.kind = status, message, param, kind


class _ClientGone(Exception):
  """The HTTP client disconnected mid-request (its slot has been released)."""


# -- reading request bodies ---------------------------------------------------------------------

_REQUIRED = object()
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
               list: "a list", dict: "an object"}


def _get(body: dict, name: str, kind, default=_REQUIRED, lo=None, hi=None):
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


def _refuse(body: dict, unsupported: dict) -> None:
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
_COMPLETION_UNSUPPORTED = dict(_COMMON_UNSUPPORTED, **{
    "suffix": lambda v: not v, "best_of": lambda v: v == 1})
_CHAT_UNSUPPORTED = dict(_COMMON_UNSUPPORTED, **{
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


# -- one generation -----------------------------------------------------------------------------

@dataclasses.dataclass
class Job:
  """One engine request: prompt ids, budget, sampling, stop ids and stop strings."""
  prompt: list
  max_tokens: int
  sampling: SamplingSettings
  stop_ids: tuple
  stop_texts: tuple = ()


@dataclasses.dataclass
class Sample:
  """What one engine request sampled (ids and logprobs include a final stop id)."""
  ids: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  finish: str = ""
  version: int = 0
  stop_text: bool = False  # ended by one of the request's stop strings


def _cut_at_stop(text: str, stops: Sequence[str]) -> Optional[int]:
  hits = [text.find(s) for s in stops if s and s in text]
  return min(hits) if hits else None


def _hold_back(text: str, stops: Sequence[str]) -> int:
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


class OpenAIFront:
  """The OpenAI-compatible HTTP server of a RolloutServer's engine.

  Args:
    server: the RolloutServer (its driver's prefill queue and slots are shared).
    config: the run config (`tokenizer` for text; `name` is the served model id).
    host, port: where to listen; port 0 = any free port (the bound one is `self.port`).
    model_name: the model id clients name; "" = config.name.
  """

  def __init__(self, server, config, host: str = "0.0.0.0", port: int = 0,
               model_name: str = ""):
    self.server = server
    self.engine = server.engine
    self.tok = chat_tokenizer.from_config(config.tokenizer)
    self.thinking = bool(config.tokenizer.thinking)
    self._formats = {t: ChatFormat(self.tok, t) for t in (True, False)}
    self._control_ids = frozenset(self.tok.added_tokens())
    self.stop_ids = tuple(int(i) for i in self.engine.stop_ids) or self._formats[True].stop_ids
    self.model_name = model_name or str(config.name)
    self.created = int(time.time())
    self.requests = 0  # generation requests served (for tests and logs)
    routes = [Route("/v1/completions", self._endpoint(self.completions), methods=["POST"]),
              Route("/v1/chat/completions", self._endpoint(self.chat), methods=["POST"]),
              Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
              Route("/health", self._endpoint(self.health), methods=["GET"])]
    self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})
    self._sock = socket.create_server((host, port), reuse_port=False)
    self.port = self._sock.getsockname()[1]
    self._uv = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                             lifespan="off", timeout_graceful_shutdown=2))
    self._thread = None

  @property
  def url(self) -> str:
    return f"http://localhost:{self.port}/v1"

  def start(self, timeout_s: float = 30.0) -> "OpenAIFront":
    self._thread = threading.Thread(target=lambda: asyncio.run(self._uv.serve([self._sock])),
                                    name="openai-http", daemon=True)
    self._thread.start()
    deadline = time.monotonic() + timeout_s
    while not self._uv.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f"the OpenAI HTTP front did not start on port {self.port}")
      time.sleep(0.02)
    logging.warning("OpenAI-compatible HTTP front on port %d (model %r)", self.port,
                    self.model_name)
    return self

  def stop(self) -> None:
    if self._thread is not None:
      self._uv.should_exit = True
      self._thread.join(10)
      self._thread = None
    self._sock.close()

  # -- responses ----------------------------------------------------------------------------

  def _json(self, content: dict, status: int = 200, v: Optional[int] = None) -> JSONResponse:
    v = self.engine.params_version if v is None else v
    return JSONResponse(content, status_code=status, headers={VERSION_HEADER: str(v)})

  def _error(self, status: int, message: str, param=None, kind="invalid_request_error"):
    return self._json({"error": {"message": message, "type": kind, "param": param,
                                 "code": status}}, status)

  async def _http_error(self, request: Request, exc: HTTPException):
    del request
    what = {404: "no such endpoint (POST /v1/completions, POST /v1/chat/completions, "
                 "GET /v1/models)", 405: "method not allowed"}.get(exc.status_code, exc.detail)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return self._error(exc.status_code, what, kind=kind)

  def _endpoint(self, fn):
    async def handle(request: Request):
      try:
        return await fn(request)
      except ApiError as e:
        return self._error(e.status, e.message, e.param, e.kind)
      except _ClientGone:
        return Response(status_code=499)
      except Exception as e:  # noqa: BLE001 - answered as a 500; the server keeps serving
        logging.exception("OpenAI front: %s %s failed", request.method, request.url.path)
        return self._error(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
    return handle

  async def _body(self, request: Request) -> dict:
    try:
      body = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object")
    model = _get(body, "model", str)
    if model != self.model_name:
      raise ApiError(404, f"model {model!r} is not served here; this server serves "
                     f"{self.model_name!r} (GET /v1/models)", "model", "not_found_error")
    return body

  # -- shared request settings --------------------------------------------------------------

  def _sampling(self, body: dict) -> SamplingSettings:
    d = self.engine.default_sampling
    top_k = _get(body, "top_k", int, d.top_k, lo=-1)
    return SamplingSettings(temperature=_get(body, "temperature", float, d.temperature, lo=0),
                            top_p=_get(body, "top_p", float, d.top_p),
                            top_k=0 if top_k == -1 else top_k,
                            seed=_get(body, "seed", int, None))

  def _stops(self, body: dict, default_ids: Sequence[int]) -> tuple:
    """(stop ids, stop strings): the default stop ids (none with vLLM's `ignore_eos`) plus
    `stop_token_ids`, and `stop` strings; a stop string that is one token is also a stop id."""
    ids = [] if _get(body, "ignore_eos", bool, False) else [int(i) for i in default_ids]
    extra = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in extra):
      raise ApiError(400, "'stop_token_ids' must be a list of integers", "stop_token_ids")
    ids += extra
    stop = body.get("stop")
    texts = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(texts, list) or not all(isinstance(s, str) and s for s in texts):
      raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
    for s in texts:
      one = self.tok.encode(s)
      if len(one) == 1 and self.tok.decode(one) == s:
        ids.append(one[0])
    return tuple(dict.fromkeys(ids)), tuple(texts)

  def _choices(self, body: dict) -> int:
    return _get(body, "n", int, 1, lo=1, hi=MAX_CHOICES)

  @staticmethod
  def _seeded(s: SamplingSettings, i: int) -> SamplingSettings:
    """The i-th choice's sampling: seed + i (each choice its own draw, reproducible)."""
    return s if s.seed is None or i == 0 else dataclasses.replace(s, seed=(s.seed + i) & _SEED_MASK)

  # -- generation ---------------------------------------------------------------------------

  def _check(self, jobs: Sequence[Job]) -> None:
    """Every job valid for the engine (before any is queued, and before a stream starts)."""
    for job in jobs:
      self._request(job)

  def _request(self, job: Job):
    """The job's validated engine request (a job of 0 tokens, an echo that only scores its
    prompt, is checked as one of 1)."""
    try:
      return orchestrator.build_request(self.engine, job.prompt, max(job.max_tokens, 1),
                                        job.sampling, job.stop_ids)
    except orchestrator.RequestError as e:
      raise ApiError(400, str(e)) from None

  async def _run(self, job: Job, channels: Optional[list] = None):
    """Yields the Sample so far after each sampled token; the last yield has `finish`.

    Stop strings are looked for in the text of the ids sampled so far; at one, the request is
    cancelled (its slot is freed at the next step) and the sample ends with finish "stop".
    The request's return channel is appended to `channels` (see `_generate_all`).
    """
    active = self._request(job)
    channel = async_multifuture.AsyncMultifuture()
    active.return_channel = channel
    try:
      self.server.driver.place_request_on_prefill_queue(active)
    except queue.Full:
      raise ApiError(503, "prefill queue full; retry", kind="server_overloaded") from None
    except orchestrator.ServerStopping as e:
      raise ApiError(503, str(e), kind=SHUTTING_DOWN) from None
    self.requests += 1
    if channels is not None:
      channels.append(channel)
    out = Sample(version=self.engine.params_version)
    window = 4 * max((len(s) for s in job.stop_texts), default=0) + 4
    try:
      async for chunk in channel:
        out.ids.append(chunk.token)
        out.logprobs.append(chunk.logprob)
        out.version = chunk.version
        out.finish = chunk.finish
        if (job.stop_texts and out.finish != orchestrator.FINISH_STOP and
            _cut_at_stop(self.tok.decode(out.ids[-window:]), job.stop_texts) is not None):
          if not out.finish:
            channel.cancel()
          out.finish, out.stop_text = orchestrator.FINISH_STOP, True
        yield out
        if out.finish:
          return
    except futures.CancelledError:
      raise _ClientGone() from None
    except orchestrator.ServerStopping as e:  # the driver stopped: answered as an error
      raise ApiError(503, str(e), kind=SHUTTING_DOWN) from None
    finally:
      if not out.finish:
        channel.cancel()  # abandoned (an error elsewhere, a disconnect): free the slot

  async def _generate(self, job: Job, channels: list) -> Sample:
    out = Sample()
    async for out in self._run(job, channels):
      pass
    return out

  async def _generate_all(self, request: Request, jobs: Sequence[Job]) -> list:
    """Every job's Sample, the jobs run at once. A client that disconnects cancels them all
    (one watcher per HTTP request reads its disconnect; a streamed response has Starlette's)."""
    channels: list = []

    async def watch():
      while (await request.receive())["type"] != "http.disconnect":
        pass
      for c in channels:
        c.cancel()
    watcher = asyncio.ensure_future(watch())
    tasks = [asyncio.ensure_future(self._generate(j, channels)) for j in jobs]
    try:
      return await asyncio.gather(*tasks)
    finally:
      watcher.cancel()
      for t in tasks:
        t.cancel()

  @staticmethod
  def _sampled(sample: Sample, job: Job) -> list:
    """The sampled ids without a final stop id (which ends the text, not part of it)."""
    ids = sample.ids
    if ids and sample.finish == orchestrator.FINISH_STOP and ids[-1] in job.stop_ids:
      return ids[:-1]
    return list(ids)

  def _text(self, sample: Sample, job: Job) -> str:
    """The sampled text: a final stop id left out, cut before the first stop string."""
    text = self.tok.decode(self._sampled(sample, job))
    cut = _cut_at_stop(text, job.stop_texts)
    return text if cut is None else text[:cut]

  def _token_strings(self, ids: Sequence[int]) -> list:
    return [self.tok.decode([int(i)]) for i in ids]

  # -- endpoints ----------------------------------------------------------------------------

  async def models(self, request: Request):
    del request
    return self._json({"object": "list", "data": [{
        "id": self.model_name, "object": "model", "created": self.created,
        "owned_by": "qwen35-rl", "max_model_len": self.engine.max_len,
        "weights_version": self.engine.params_version, "server_version": version.__version__}]})

  async def health(self, request: Request):
    del request
    return self._json({"status": "ok", "weights_version": self.engine.params_version,
                       "busy_slots": self.server.busy_slots(), "slots": self.engine.slots})

  def _prompts(self, raw) -> list:
    """`prompt`: a string, a list of token ids, or a list of strings / of token-id lists."""
    is_ids = lambda x: isinstance(x, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in x)
    if isinstance(raw, str):
      return [self.tok.encode(raw)]
    if isinstance(raw, list) and raw:
      if is_ids(raw):
        return [list(raw)]
      if all(isinstance(x, str) for x in raw):
        return [self.tok.encode(x) for x in raw]
      if all(is_ids(x) for x in raw):
        return [list(x) for x in raw]
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a non-empty list "
                   "of strings or of token-id lists", "prompt")

  async def completions(self, request: Request):
    body = await self._body(request)
    _refuse(body, _COMPLETION_UNSUPPORTED)
    prompts = self._prompts(body.get("prompt"))
    n = self._choices(body)
    echo = _get(body, "echo", bool, False)
    max_tokens = _get(body, "max_tokens", int, 16, lo=0 if echo else 1)
    logprobs = self._logprobs_wanted(body, echo, max_tokens)
    want_ids = _get(body, "return_token_ids", bool, False)
    sampling = self._sampling(body)
    stop_ids, stop_texts = self._stops(body, self.stop_ids)
    jobs = [Job(p, max_tokens, self._seeded(sampling, i), stop_ids, stop_texts)
            for p in prompts for i in range(n)]
    self._check(jobs)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if _get(body, "stream", bool, False):
      if echo:
        raise ApiError(400, "'echo' with 'stream' is not supported by this server: ask without "
                       "'stream' (docs/openai_endpoint.md)", "echo")
      return self._stream_completion(body, jobs, rid, created, logprobs, want_ids)
    if echo:
      samples, scores = await asyncio.gather(
          self._generate_all(request, [j for j in jobs if j.max_tokens > 0]),
          asyncio.to_thread(lambda: [self.engine.score(p) for p in prompts]))
      # max_tokens = 0: the prompt alone, scored by the weights that scored it.
      samples = samples or [Sample(finish=orchestrator.FINISH_LENGTH, version=scores[0].version)
                            for _ in jobs]
    else:
      samples, scores = await self._generate_all(request, jobs), None
    choices = []
    for i, (job, s) in enumerate(zip(jobs, samples)):
      c = {"index": i, "text": self._text(s, job), "finish_reason": s.finish, "logprobs": None,
           "weights_version": s.version}
      if logprobs is not None:
        c["logprobs"] = self._completion_logprobs(s.ids, s.logprobs, logprobs, 0)
      if echo:
        self._echo(c, job, scores[i // n], logprobs)
      if want_ids:
        c["token_ids"], c["prompt_token_ids"] = list(s.ids), list(job.prompt)
      choices.append(c)
    v = max(s.version for s in samples)
    return self._json({"id": rid, "object": "text_completion", "created": created,
                       "model": self.model_name, "choices": choices,
                       "usage": self._usage(prompts, samples), "weights_version": v}, v=v)

  @staticmethod
  def _logprobs_wanted(body: dict, echo: bool, max_tokens: int) -> Optional[int]:
    """`logprobs` of a completion request: 0 or 1 (the sampled token's logprob; the engine
    computes no alternatives for sampled tokens), and with `echo` up to TOP_LOGPROBS
    alternatives for the prompt's tokens when nothing is sampled (max_tokens = 0)."""
    logprobs = _get(body, "logprobs", int, None, lo=0, hi=TOP_LOGPROBS if echo else None)
    if logprobs is not None and logprobs > 1 and not (echo and max_tokens == 0):
      raise ApiError(400, f"'logprobs'={logprobs} is not supported here: the engine computes the "
                     "sampled token's logprob only (logprobs 0 or 1); alternatives up to "
                     f"{TOP_LOGPROBS} are served for the prompt's tokens, with echo=true and "
                     "max_tokens=0 (docs/openai_endpoint.md)", "logprobs")
    return logprobs

  def _echo(self, choice: dict, job: Job, scores, top: Optional[int]) -> None:
    """Puts the prompt in front of a completion choice, as echo asks: its text, and with
    logprobs its tokens' logprobs (the first None: it has no context, as vLLM and OpenAI
    answer) and, with `top` >= 1, the `top` likeliest tokens at each position plus the prompt's
    own. The prompt's logprobs are the model's (temperature 1), from `engine.score`."""
    prompt_text = self.tok.decode(job.prompt)
    choice["text"] = prompt_text + choice["text"]
    choice["weights_version"] = max(choice["weights_version"], scores.version)
    if top is None:
      return
    tokens = self._token_strings(job.prompt)
    lps = [None] + [float(x) for x in scores.logprobs[1:]]
    tops = None
    if top:
      tops = [None]
      for i in range(1, len(job.prompt)):
        alts = {}
        for t, x in [(tokens[i], scores.logprobs[i])] + list(zip(
            self._token_strings(scores.top_ids[i, :top]), scores.top_logprobs[i, :top])):
          alts[t] = max(float(x), alts.get(t, -float("inf")))  # two ids may print alike
        tops.append(alts)
    sampled = choice["logprobs"]
    offsets = list(itertools.accumulate([0] + [len(t) for t in tokens]))
    choice["logprobs"] = {
        "tokens": tokens + sampled["tokens"],
        "token_logprobs": lps + sampled["token_logprobs"],
        "top_logprobs": None if tops is None else tops + sampled["top_logprobs"],
        "text_offset": offsets[:-1] + [offsets[-1] + o for o in sampled["text_offset"]]}

  def _completion_logprobs(self, ids, logprobs, top: int, offset: int) -> dict:
    tokens = self._token_strings(ids)
    offsets = []
    for t in tokens:
      offsets.append(offset)
      offset += len(t)
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logprobs],
            "top_logprobs": [{t: float(x)} for t, x in zip(tokens, logprobs)] if top else None,
            "text_offset": offsets}

  @staticmethod
  def _usage(prompts, samples) -> dict:
    p = sum(len(x) for x in prompts)
    c = sum(len(s.ids) for s in samples)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

  def _one_stream(self, jobs: Sequence[Job]) -> Job:
    if len(jobs) != 1:
      raise ApiError(400, "'stream' serves one choice: one prompt and n = 1", "stream")
    return jobs[0]

  def _sse(self, events, v: int) -> StreamingResponse:
    """Server-sent events; a refusal once the stream has begun (its status line is sent, e.g.
    a full prefill queue) ends it with an error event."""
    async def guarded():
      try:
        async for e in events:
          yield e
      except ApiError as e:
        yield _event({"error": {"message": e.message, "type": e.kind, "param": e.param,
                                "code": e.status}})
        yield "data: [DONE]\n\n"
    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={VERSION_HEADER: str(v), "cache-control": "no-cache"})

  def _stream_completion(self, body, jobs, rid, created, logprobs, want_ids):
    job = self._one_stream(jobs)
    usage = bool((_get(body, "stream_options", dict, {}) or {}).get("include_usage"))

    async def events():
      sent, text_len = 0, 0
      async for s in self._run(job):
        text = self._text(s, job) if s.finish else self._partial_text(s, job)
        delta, sent = text[sent:], max(sent, len(text))
        new = slice(len(s.ids) - 1, len(s.ids))
        c = {"index": 0, "text": delta, "finish_reason": s.finish or None, "logprobs": None,
             "weights_version": s.version}
        if logprobs is not None:
          c["logprobs"] = self._completion_logprobs(s.ids[new], s.logprobs[new], logprobs,
                                                    text_len)
          text_len += sum(len(t) for t in c["logprobs"]["tokens"])
        if want_ids:
          c["token_ids"] = s.ids[new]
          if len(s.ids) == 1:
            c["prompt_token_ids"] = list(job.prompt)
        yield _event({"id": rid, "object": "text_completion", "created": created,
                      "model": self.model_name, "choices": [c], "weights_version": s.version})
      if usage:
        yield _event({"id": rid, "object": "text_completion", "created": created,
                      "model": self.model_name, "choices": [],
                      "usage": self._usage([job.prompt], [s])})
      yield "data: [DONE]\n\n"
    return self._sse(events(), self.engine.params_version)

  def _partial_text(self, s: Sample, job: Job) -> str:
    """The text of an unfinished sample that may be sent: without a tail that could still
    change (an incomplete character) or turn out to be a stop string."""
    text = self.tok.decode(s.ids)
    return text[:len(text) - _hold_back(text, job.stop_texts)]

  # -- chat ---------------------------------------------------------------------------------

  def _chat_format(self, body: dict) -> ChatFormat:
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    thinking = kwargs.get("enable_thinking", self.thinking)
    if not isinstance(thinking, bool):
      raise ApiError(400, "'chat_template_kwargs.enable_thinking' must be a boolean",
                     "chat_template_kwargs")
    return self._formats[thinking]

  async def chat(self, request: Request):
    body = await self._body(request)
    _refuse(body, _CHAT_UNSUPPORTED)
    messages, tools = chat_messages(body.get("messages")), chat_tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
      raise ApiError(400, "'tool_choice' may be 'auto' or 'none' (a required or named tool "
                     "is not supported)", "tool_choice")
    fmt = self._chat_format(body)
    try:
      prompt = fmt.render_ids(messages, tools)
    except (ValueError, KeyError, TypeError) as e:
      raise ApiError(400, f"messages cannot be rendered: {e}", "messages") from None
    budget = self.engine.max_len - len(prompt)
    max_tokens = _get(body, "max_completion_tokens", int, None, lo=1) or _get(
        body, "max_tokens", int, max(budget, 1), lo=1)
    want_lp = _get(body, "logprobs", bool, False)
    want_ids = _get(body, "return_token_ids", bool, False)
    keep_special = not _get(body, "skip_special_tokens", bool, True)
    stop_ids, stop_texts = self._stops(body, fmt.stop_ids)
    sampling = self._sampling(body)
    jobs = [Job(prompt, max_tokens, self._seeded(sampling, i), stop_ids, stop_texts)
            for i in range(self._choices(body))]
    schemas = ({t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
               if choice == "auto" else None)
    self._check(jobs)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if _get(body, "stream", bool, False):
      return self._stream_chat(body, fmt, jobs, schemas, rid, created, want_lp, want_ids,
                               keep_special)
    samples = await self._generate_all(request, jobs)
    choices = []
    for i, (job, s) in enumerate(zip(jobs, samples)):
      message, finish = self._assistant_message(fmt, s, job, schemas, keep_special)
      c = {"index": i, "message": message, "finish_reason": finish, "logprobs": None,
           "weights_version": s.version}
      if want_lp:
        c["logprobs"] = {"content": self._chat_logprobs(s.ids, s.logprobs)}
      if want_ids:
        c["token_ids"] = list(s.ids)
      choices.append(c)
    v = max(s.version for s in samples)
    out = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
           "choices": choices, "usage": self._usage([prompt], samples), "weights_version": v}
    if want_ids:
      out["prompt_token_ids"] = list(prompt)
    return self._json(out, v=v)

  def _chat_logprobs(self, ids, logprobs) -> list:
    return [{"token": t, "logprob": float(x), "bytes": list(t.encode("utf-8")),
             "top_logprobs": []} for t, x in zip(self._token_strings(ids), logprobs)]

  def _decode(self, ids: Sequence[int], keep_special: bool) -> str:
    """Text of `ids`; without `keep_special` the control tokens (`<|im_start|>`, `<tool_call>`,
    ...) are left out, as vLLM's `skip_special_tokens` does by default."""
    if not keep_special:
      ids = [i for i in ids if i not in self._control_ids]
    return self.tok.decode(ids)

  def _turn_view(self, fmt: ChatFormat, ids: Sequence[int], schemas, keep_special: bool,
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
    head = self._decode(ids[:first], keep_special)
    bare = head.find(_FUNCTION_TAG)   # a call written without its <tool_call> tags
    view = {"reasoning": self._decode(reasoning, keep_special).strip(),
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
        view["content"] = self._decode(outside, keep_special)
        view["calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": c.name, "arguments": json.dumps(
                              c.arguments, ensure_ascii=False)}} for c in turn.tool_calls]
      else:
        view["error"] = {"message": turn.error.reason, "text": raw.strip()}
    view["content"] = view["content"].strip()
    return view

  def _assistant_message(self, fmt: ChatFormat, s: Sample, job: Job, schemas,
                         keep_special: bool) -> tuple:
    """(message, finish_reason) of a sampled turn: reasoning, content and the tool calls the
    harness's parser reads in it, or `tool_call_error` for a call it cannot read (the content
    then ends before the call; `_turn_view`)."""
    view = self._turn_view(fmt, self._sampled(s, job), schemas, keep_special, final=True)
    content, calls = view["content"], view["calls"]
    cut = _cut_at_stop(content, job.stop_texts)
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

  def _stream_chat(self, body, fmt, jobs, schemas, rid, created, want_lp, want_ids,
                   keep_special):
    job = self._one_stream(jobs)
    usage = bool((_get(body, "stream_options", dict, {}) or {}).get("include_usage"))
    head = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": self.model_name}

    def chunk(delta, s, finish=None, extra=None):
      c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None,
           "weights_version": s.version}
      c.update(extra or {})
      return _event(dict(head, choices=[c], weights_version=s.version))

    async def events():
      sent = {"reasoning_content": "", "content": ""}
      first = True
      async for s in self._run(job):
        message, finish = (self._assistant_message(fmt, s, job, schemas, keep_special)
                           if s.finish else ({}, None))
        if s.finish:
          shown = {"reasoning_content": message.get("reasoning_content", ""),
                   "content": message.get("content") or ""}
        else:
          # Text up to the first tool call, less a tail that may still change: an incomplete
          # character, the start of a stop string or of a call written without its tags.
          view = self._turn_view(fmt, self._sampled(s, job), schemas, keep_special,
                                 final=False)
          cut = _cut_at_stop(view["content"], job.stop_texts)
          visible = view["content"] if cut is None else view["content"][:cut]
          visible = visible[:len(visible) - _hold_back(visible, job.stop_texts
                                                       + (_FUNCTION_TAG,))]
          reasoning = view["reasoning"]
          shown = {"reasoning_content": reasoning[:len(reasoning) - _hold_back(reasoning, ())],
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
          extra["logprobs"] = {"content": self._chat_logprobs(s.ids[-1:], s.logprobs[-1:])}
        if want_ids:
          extra["token_ids"] = s.ids[-1:]
        if delta or extra or s.finish:
          yield chunk(delta, s, finish, extra)
      if usage:
        yield _event(dict(head, choices=[], usage=self._usage([job.prompt], [s])))
      yield "data: [DONE]\n\n"
    return self._sse(events(), self.engine.params_version)


def _event(obj: Any) -> str:
  return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"
