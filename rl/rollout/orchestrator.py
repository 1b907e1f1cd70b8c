"""JetStream's Driver and gRPC orchestrator, extended for token-in/token-out with logprobs.

    server = RolloutServer(engine, port=9000).start()
    ...                                     # clients call JetStream's Decode RPC
    server.update_weights(new_params)       # weight sync between rollout phases
    server.stop()

What is extended, and why (JetStream 0.2.2 itself is used unchanged):
- `TitoDriver(Driver)`:
  * `_generate_thread` survives JetStream's slot-count race (an assert that fails when the
    last busy slot is freed mid-step, after which JetStream SIGKILLs the process);
  * `_process_prefill_content` pads the prompt ids to the engine's bucket and attaches the
    request's sampling settings (JetStream's version would prepend a BOS id and knows no
    sampling settings);
  * `_detokenize_thread` is replaced: it hands each slot's token *and logprob* to its
    request, applies the request's own stop ids (returning the stop id itself, as the chat
    harness expects) and max_tokens, names the finish reason, and frees the slot of a
    request whose client went away at the next step (JetStream's thread keeps decoding a
    cancelled request until max_tokens);
  * `stop` first ends every request it had accepted with `ServerStopping` (the fronts answer
    it as an error: gRPC UNAVAILABLE, HTTP 503) and refuses new ones, then stops the threads
    without JetStream's busy loop (which, refilling the one-place queues with sentinels,
    could keep a thread blocked on a full queue for minutes), within a bound.
- `TitoOrchestrator(LLMOrchestrator)`: `Decode` validates the request before it reaches the
  driver (a bad prompt in JetStream's prefill thread kills the process), reads the extended
  fields (envs/jetstream_wire.py) and streams extended responses.
- `RolloutServer`: JetStream's `JetStreamServer` hard-wires the plain orchestrator, so the
  gRPC server (asyncio loop thread + grpc.aio) is assembled here around `TitoOrchestrator`.
"""
import asyncio
import dataclasses
import logging
import queue
import threading
import time
from concurrent import futures
from typing import Optional, Sequence

from rl.rollout import compat  # noqa: F401  (patches JetStream on import, before its orchestrator runs)

import grpc
from jetstream.core import orchestrator
from jetstream.core.proto import jetstream_pb2
from jetstream.core.proto import jetstream_pb2_grpc
from jetstream.core.utils import async_multifuture
from jetstream.engine import engine_api

from envs import jetstream_wire
from rl.rollout.engine import PrefillInput
from rl.rollout.engine import QwenEngine
from rl.rollout.engine import SamplingSettings
from rl.rollout.engine_programs import MAX_STOP_IDS

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class ServerStopping(RuntimeError):
  """The server is stopping: a request it had accepted ends unanswered, a new one is refused."""


@dataclasses.dataclass
class TitoRequest(orchestrator.ActiveRequest):
  """JetStream's ActiveRequest plus what token-in/token-out needs."""
  sampling: SamplingSettings = SamplingSettings()
  stop_ids: frozenset = frozenset()
  prompt_len: int = 0
  emitted: int = 0
  sampled: list = dataclasses.field(default_factory=list)  # the ids emitted so far


@dataclasses.dataclass
class Chunk:
  """One step's output for one request (what the detokenize thread sends to Decode)."""
  token: int
  logprob: float
  finish: str = ""
  version: int = 0


class TitoDriver(orchestrator.Driver):
  """JetStream's Driver with per-request stop ids, logprobs, and slot release on disconnect."""

  def __init__(self, *args, **kwargs):
    self.cancelled_requests = 0  # requests whose client went away before they finished
    self.slot_race_restarts = 0  # times the generate loop was re-entered after the race below
    self._busy: dict[int, int] = {}  # generate engine -> slots holding a live request
    # Return channels of the requests accepted and not yet finished: `stop` ends each with an
    # error. Requests are accepted and the set taken under the lock, so none slips in between.
    self._open_lock = threading.Lock()
    self._open: set = set()
    super().__init__(*args, **kwargs)

  def place_request_on_prefill_queue(self, request: orchestrator.ActiveRequest) -> None:
    """Queues `request` for prefill; raises ServerStopping once `stop` has begun (nothing
    would answer it) and queue.Full as JetStream does."""
    with self._open_lock:
      if not self.live:
        raise ServerStopping("the server is shutting down")
      super().place_request_on_prefill_queue(request)
      if request.return_channel is not None:
        self._open.add(request.return_channel)

  def _finished(self, channel) -> None:
    with self._open_lock:
      self._open.discard(channel)

  def _generate_thread(self, idx: int):
    """JetStream's generate loop, entered again after its slot-count race instead of dying.

    After trying to fill free slots without blocking, JetStream's loop asserts that some slot
    is still busy. The detokenize thread frees slots concurrently, so when the last busy
    request finishes between the loop's count of free slots and that assert, the assert fails
    with every slot free, and JetStream's thread wrapper SIGKILLs the whole process (it killed
    a GRPO run at step 5). Every slot free means no request is in the decode state, so nothing
    is lost by leaving the loop and entering it again (fresh decode state; it then blocks
    for the next request). Any other failure still propagates.
    """
    while self.live:
      try:
        return super()._generate_thread(idx)
      except AssertionError:
        engine = self._generate_engines[idx]
        if self._generate_slots[idx].qsize() < engine.max_concurrent_decodes:
          raise
        self.slot_race_restarts += 1
        logging.warning("generate thread %d: every slot freed during its step (JetStream's "
                        "slot-count race); loop entered again", idx)

  def _process_prefill_content(self, request, tokenizer, is_bos, max_prefill_length):
    del tokenizer, is_bos, max_prefill_length
    engine = self._prefill_engines[0]
    ids = request.prefill_content
    return PrefillInput(engine.pad_prompt(ids), request.sampling, tuple(sorted(request.stop_ids)),
                        request.max_tokens), len(ids)

  def stop(self, timeout_s: float = 5.0) -> None:
    """Ends every accepted request with ServerStopping, then stops the driver's threads.

    The requests first: each one queued or decoding gets the error at once (its front answers
    it: gRPC UNAVAILABLE, an HTTP 503 or a stream's error event), and any request placed
    from now on is refused, so no client waits on a server that is going away.

    Then the threads, as JetStream's `stop` does but without its busy loop. A thread ends when
    it sees `live` false at the top of its loop or takes a sentinel (None) from the queue it
    reads; a thread blocked putting into a full queue ends once that queue has room. JetStream
    drains every queue and puts a sentinel in each, again and again with no pause: the
    transfer and generate queues hold one item (interleaved mode), so the sentinel it puts
    fills the room it just made, and a prefill or transfer thread blocked on such a queue
    whose reader has already gone never gets in (the serve process outlived its signal by
    minutes under load). Here each round drains every queue (requests still queued lose their
    return channel), puts a sentinel only where a thread still reads that queue, and waits
    briefly on the threads. Threads still alive after `timeout_s` (daemon threads; one
    inside a long device computation) are logged and left behind.
    """
    with self._open_lock:
      self.live = False
      channels, self._open = self._open, set()
    for channel in channels:
      try:
        channel.set_exception(ServerStopping("the server is shutting down"))
      except RuntimeError:  # its client's event loop is closed: nobody waits on it
        pass
    readers = [(self._prefill_backlog, self._prefill_threads)]
    readers += [(q, [t]) for q, t in zip(self._transfer_backlogs, self._transfer_threads)]
    readers += [(self._generate_backlogs[i], [t]) for i, t in enumerate(self._generate_threads)]
    readers += [(q, [t]) for q, t in zip(self._detokenize_backlogs, self.detokenize_threads)]
    deadline = time.monotonic() + timeout_s
    alive = list(self._all_threads)
    while alive and time.monotonic() < deadline:
      for q, threads in readers:
        _cancel_queued(q)
        if any(t.is_alive() for t in threads):
          try:
            q.put_nowait(None)
          except queue.Full:
            pass
      round_end = time.monotonic() + 0.05
      for t in alive:
        t.join(max(0.0, round_end - time.monotonic()))
      alive = [t for t in alive if t.is_alive()]
    if alive:
      logging.warning("driver stop: threads %s still running after %.0f s; left behind",
                      [t.name for t in alive], timeout_s)

  def busy_slots(self, idx: int = 0) -> int:
    """Slots of generate engine `idx` that hold a live request.

    (The free-slot queue's size is no measure: JetStream's idle generate thread holds one
    free slot while it waits for work.)
    """
    return self._busy.get(idx, 0)

  def _detokenize_thread(self, idx: int):
    backlog = self._detokenize_backlogs[idx]
    engine = self._generate_engines[idx]
    slots = self._generate_slots[idx]
    live: dict[int, Optional[TitoRequest]] = {}

    def release(slot):
      live[slot] = None
      self._busy[idx] = sum(r is not None for r in live.values())
      slots.put(slot, block=False)

    while self.live:
      data = backlog.get(block=True)
      if data is None:
        break
      if not isinstance(data[1], engine_api.ResultTokens):
        slot, request = data  # from now on, `slot`'s tokens belong to `request`
        live[slot] = request
        self._busy[idx] = sum(r is not None for r in live.values())
        continue
      result = data[1].convert_to_numpy()
      version = engine.params_version
      for slot, request in list(live.items()):
        if request is None:
          continue
        channel = request.return_channel
        if channel is None or channel.cancelled():
          self.cancelled_requests += 1
          self._finished(channel)
          release(slot)
          continue
        token = int(result.data[slot, result.tokens_idx[0]])
        logprob = float(result.logprobs[slot, 0])
        request.emitted += 1
        finish = ""
        if token in request.stop_ids:
          finish = FINISH_STOP
        elif request.emitted >= request.max_tokens:
          finish = FINISH_LENGTH
        channel.add_result(Chunk(token, logprob, finish, version))
        if engine.keeps_turns:
          request.sampled.append(token)
        if finish:
          channel.close()
          self._finished(channel)
          # The slot's state now holds the whole conversation so far (frozen on the device
          # once the request finished); kept before the slot is freed for another request.
          if engine.keeps_turns and len(request.stop_ids) <= MAX_STOP_IDS:
            engine.keep_turn(slot, list(request.prefill_content) + request.sampled)
          release(slot)


def _cancel_queued(q: queue.Queue) -> None:
  """Empties `q`, detaching each queued request from its client (its stream then ends)."""
  while True:
    try:
      item = q.get_nowait()
    except queue.Empty:
      return
    # Detokenize backlogs hold (slot, request) or (slot, result) pairs, the others requests.
    request = item[1] if isinstance(item, tuple) else item
    if isinstance(request, orchestrator.ActiveRequest):
      request.return_channel = None


class RequestError(ValueError):
  """A request the server refuses (answered with INVALID_ARGUMENT)."""


def build_request(engine: QwenEngine, ids: Sequence[int], max_tokens: int,
                  sampling: SamplingSettings, stop_ids: Sequence[int],
                  client_side: bool = True) -> TitoRequest:
  """A validated request (no return channel yet) for the driver's prefill queue: the checks
  every front end shares (gRPC Decode, the OpenAI-compatible HTTP front). Raises RequestError."""
  ids = [int(i) for i in ids]
  if not ids:
    raise RequestError("empty prompt: at least one token id is required")
  vocab = engine.cfg.vocab_size
  bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab]
  if bad:
    raise RequestError(f"token id {bad[0][1]} at position {bad[0][0]} is outside the vocabulary "
                       f"[0, {vocab}) ({len(bad)} such ids)")
  longest = min(engine.max_prefill_length, engine.max_len - 1)
  if len(ids) > longest:
    raise RequestError(f"prompt of {len(ids)} tokens is longer than the context allows: at most "
                       f"{longest} prompt tokens (max_len {engine.max_len})")
  if max_tokens < 1:
    raise RequestError(f"max_tokens must be >= 1, got {max_tokens}")
  s = sampling
  if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < 0:
    raise RequestError(f"bad sampling settings: temperature {s.temperature} (>= 0), top_p "
                       f"{s.top_p} (in (0, 1]), top_k {s.top_k} (>= 0)")
  return TitoRequest(
      # The cache holds max_len tokens: a request that would overrun it ends with "length".
      max_tokens=min(int(max_tokens), engine.max_len - len(ids)),
      return_channel=None, prefill_content=ids, is_client_side_tokenization=client_side,
      sampling=s, stop_ids=frozenset(int(i) for i in stop_ids), prompt_len=len(ids))


class TitoOrchestrator(orchestrator.LLMOrchestrator):
  """JetStream's gRPC servicer, reading and writing the extended messages."""

  def __init__(self, driver: TitoDriver, engine: QwenEngine):
    super().__init__(driver=driver)
    self._engine = engine
    self._tokenizer = None
    self._tokenizer_lock = threading.Lock()

  def _text_tokenizer(self):
    with self._tokenizer_lock:
      if self._tokenizer is None:
        self._tokenizer = self._engine.build_tokenizer(self._engine.get_tokenizer())
      return self._tokenizer

  def parse(self, request) -> TitoRequest:
    """Validates a DecodeRequest (JetStream's or the extended one) -> a TitoRequest sans channel."""
    engine = self._engine
    ext = jetstream_wire.DecodeRequest.FromString(request.SerializeToString())
    which = request.WhichOneof("content")
    if which == "token_content":
      ids = [int(i) for i in request.token_content.token_ids]
    elif which == "text_content":
      ids = [int(i) for i in self._text_tokenizer().encode(request.text_content.text)[0]]
    else:
      raise RequestError("request has no content (token_content or text_content)")
    s = engine.default_sampling
    if ext.HasField("sampling"):
      sp = ext.sampling
      s = SamplingSettings(sp.temperature, sp.top_p, sp.top_k, sp.seed if sp.has_seed else None)
    stop_ids = ext.stop_ids if ext.has_stop_ids else engine.stop_ids
    return build_request(engine, ids, int(request.max_tokens), s, stop_ids,
                         client_side=(which == "token_content"))

  def _response(self, chunks: Sequence[Chunk], text: bool):
    resp = jetstream_wire.DecodeResponse()
    sample = resp.stream_content.samples.add(
        token_ids=[c.token for c in chunks], logprobs=[c.logprob for c in chunks],
        finish_reason=chunks[-1].finish, weights_version=chunks[-1].version)
    if text:
      sample.text = self._text_tokenizer().decode([c.token for c in chunks])
    # Re-read as JetStream's message so its generated serializer sends it; the extended
    # fields travel as unknown fields.
    return jetstream_pb2.DecodeResponse.FromString(resp.SerializeToString())

  async def Decode(self, request, context=None):  # pylint: disable=invalid-overridden-method
    try:
      active = self.parse(request)
    except RequestError as e:
      if context is None:
        raise
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
      return
    active.return_channel = async_multifuture.AsyncMultifuture()
    if context is not None:
      # Fires when the RPC ends for any reason, a client going away included.
      context.add_done_callback(active.return_channel.cancel)
    try:
      self._driver.place_request_on_prefill_queue(active)
      async for chunk in active.return_channel:
        yield self._response([chunk], text=not active.is_client_side_tokenization)
    except queue.Full:
      if context is None:
        raise
      await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prefill queue full; retry")
    except ServerStopping as e:   # refused, or ended unanswered, as the server stops
      if context is None:
        raise
      await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


class RolloutServer:
  """The engine behind JetStream's Driver and gRPC service, on `port` (0 = any free port).

  Args:
    engine: a QwenEngine.
    port: TCP port; the bound one is `self.port`.
    threads: gRPC handler threads; None = max(slots, 64).
  """

  def __init__(self, engine: QwenEngine, port: int = 0, threads: Optional[int] = None):
    self.engine = engine
    handle = engine.load_params()
    self.driver = TitoDriver(prefill_engines=[engine], generate_engines=[engine],
                             prefill_params=[handle], generate_params=[handle],
                             interleaved_mode=True)
    threads = threads or max(engine.max_concurrent_decodes, 64)
    self._executor = futures.ThreadPoolExecutor(max_workers=threads)
    self._loop = asyncio.new_event_loop()
    self._loop.set_default_executor(self._executor)
    self._loop_thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop",
                                         daemon=True)
    self._loop_thread.start()

    async def build():
      server = grpc.aio.server(self._executor)
      jetstream_pb2_grpc.add_OrchestratorServicer_to_server(TitoOrchestrator(self.driver, engine),
                                                            server)
      return server, server.add_insecure_port(f"[::]:{port}")

    self._server, self.port = self._run(build())
    self._stopped = False

  def _run(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

  @property
  def address(self) -> str:
    return f"localhost:{self.port}"

  def start(self) -> "RolloutServer":
    self._run(self._server.start())
    logging.warning("JetStream rollout server on port %d: %d slots, max_len %d, buckets %s",
                    self.port, self.engine.slots, self.engine.max_len, self.engine.buckets)
    return self

  def update_weights(self, params, version: Optional[int] = None) -> int:
    """Weight sync: generations started after this call use `params` (rl/rollout/README.md,
    "Weight sync")."""
    return self.engine.update_params(params, version)

  def busy_slots(self) -> int:
    return self.driver.busy_slots(0)

  def wait_for_termination(self, poll_s: float = 0.5) -> None:
    """Blocks until the server stops; Ctrl-C (KeyboardInterrupt) stops it and is re-raised.

    The wait is in slices of `poll_s`: a SIGINT that the kernel hands to another thread of the
    process (gRPC's, XLA's) only sets CPython's flag, and a main thread blocked without a
    timeout would never run the handler (the serve process once outlived its Ctrl-C by 240 s
    this way, stacks showing the main thread still in this wait).
    """
    done = asyncio.run_coroutine_threadsafe(self._server.wait_for_termination(), self._loop)
    try:
      while True:
        try:
          done.result(timeout=poll_s)
          return
        except futures.TimeoutError:
          continue
    finally:
      self.stop()   # which also ends the server's own wait

  def stop(self) -> None:
    """Stops serving within seconds: the driver first (every request accepted over gRPC or the
    HTTP front ends with an error, and new ones are refused; TitoDriver.stop), then the gRPC
    server, whose RPCs have by then ended (any other gets 1 s)."""
    if self._stopped:
      return
    self._stopped = True
    self.driver.stop()
    asyncio.run_coroutine_threadsafe(self._server.stop(grace=1), self._loop).result(60)
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._loop_thread.join(60)
    self._executor.shutdown(wait=False)
