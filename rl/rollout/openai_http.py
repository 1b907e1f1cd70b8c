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

The server runs uvicorn (Starlette) on its own thread and event loop. This module is the app:
the endpoints and the bridge to the driver; reading requests is rl/rollout/openai_requests.py,
rendering responses rl/rollout/openai_render.py, streaming them rl/rollout/openai_stream.py.
"""
import asyncio
import json
import logging
import queue
import socket
import threading
import time
import uuid
from concurrent import futures
from typing import Optional, Sequence

from jetstream.core.utils import async_multifuture
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.responses import Response
from starlette.routing import Route
import uvicorn

from envs import version
from envs.chat import ChatFormat
from envs.chat import tokenizer as chat_tokenizer
from rl.rollout import openai_requests
from rl.rollout import openai_stream
from rl.rollout import orchestrator
from rl.rollout.openai_render import VERSION_HEADER
from rl.rollout.openai_render import Renderer
from rl.rollout.openai_render import Sample
from rl.rollout.openai_render import cut_at_stop
from rl.rollout.openai_render import error_body
from rl.rollout.openai_render import usage
from rl.rollout.openai_requests import ApiError
from rl.rollout.openai_requests import Job
from rl.rollout.openai_requests import get

# The error type of a request the server ends unanswered (or refuses) because it is stopping:
# HTTP 503, or a stream's last event before [DONE].
SHUTTING_DOWN = "server_shutting_down"


class _ClientGone(Exception):
  """The HTTP client disconnected mid-request (its slot has been released)."""


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
    self.render = Renderer(self.tok)
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
    return self._json(error_body(status, message, param, kind), status)

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
    model = get(body, "model", str)
    if model != self.model_name:
      raise ApiError(404, f"model {model!r} is not served here; this server serves "
                     f"{self.model_name!r} (GET /v1/models)", "model", "not_found_error")
    return body

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
            cut_at_stop(self.tok.decode(out.ids[-window:]), job.stop_texts) is not None):
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

  async def completions(self, request: Request):
    body = await self._body(request)
    req = openai_requests.completion_request(body, self.tok, self.engine.default_sampling,
                                             self.stop_ids)
    prompts, jobs, n, echo, logprobs = req.prompts, req.jobs, req.n, req.echo, req.logprobs
    self._check(jobs)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if get(body, "stream", bool, False):
      if echo:
        raise ApiError(400, "'echo' with 'stream' is not supported by this server: ask without "
                       "'stream' (docs/openai_endpoint.md)", "echo")
      return openai_stream.completion_stream(
          self._run, self.render, self.model_name, self.engine.params_version, body, jobs, rid,
          created, logprobs, req.want_ids)
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
      c = {"index": i, "text": self.render.text(s, job), "finish_reason": s.finish,
           "logprobs": None, "weights_version": s.version}
      if logprobs is not None:
        c["logprobs"] = self.render.completion_logprobs(s.ids, s.logprobs, logprobs, 0)
      if echo:
        self.render.echo(c, job, scores[i // n], logprobs)
      if req.want_ids:
        c["token_ids"], c["prompt_token_ids"] = list(s.ids), list(job.prompt)
      choices.append(c)
    v = max(s.version for s in samples)
    return self._json({"id": rid, "object": "text_completion", "created": created,
                       "model": self.model_name, "choices": choices,
                       "usage": usage(prompts, samples), "weights_version": v}, v=v)

  async def chat(self, request: Request):
    body = await self._body(request)
    req = openai_requests.chat_request(body, self.tok, self._formats, self.thinking,
                                       self.engine.default_sampling, self.engine.max_len)
    jobs = req.jobs
    self._check(jobs)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if get(body, "stream", bool, False):
      return openai_stream.chat_stream(self._run, self.render, self.model_name,
                                       self.engine.params_version, body, req, rid, created)
    samples = await self._generate_all(request, jobs)
    choices = []
    for i, (job, s) in enumerate(zip(jobs, samples)):
      message, finish = self.render.assistant_message(req.fmt, s, job, req.schemas,
                                                      req.keep_special)
      c = {"index": i, "message": message, "finish_reason": finish, "logprobs": None,
           "weights_version": s.version}
      if req.want_lp:
        c["logprobs"] = {"content": self.render.chat_logprobs(s.ids, s.logprobs)}
      if req.want_ids:
        c["token_ids"] = list(s.ids)
      choices.append(c)
    v = max(s.version for s in samples)
    out = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
           "choices": choices, "usage": usage([req.prompt], samples), "weights_version": v}
    if req.want_ids:
      out["prompt_token_ids"] = list(req.prompt)
    return self._json(out, v=v)
