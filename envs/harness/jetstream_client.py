"""The token-in/token-out client of the JetStream rollout server, and the harness policy on top.

    client = TokenClient("localhost:9000")
    out = client.generate([ids...], SamplingParams(temperature=1.0, seed=7), max_tokens=256,
                          stop_ids=(2, 0))
    out.ids, out.logprobs, out.finish_reason          # "stop" (stop id last) | "length"

    policy = JetStreamPolicy(client)                  # envs.harness.policy.Policy
    ids, logprobs, finish = policy.generate(prompt_ids, sampling, max_tokens, stop_ids)

No text on the path: ids go in as `token_content`, ids and logprobs come back. It needs only
grpc and protobuf (no JetStream, no JAX), so agent-loop processes stay light.

It lives in the harness rather than with the server in rl/rollout: the harness's own eval
(envs/harness/harness_eval.py) talks to a served policy through it and envs must not import rl.
The wire format both ends speak is envs/jetstream_wire.py; the server (rl/rollout/orchestrator.py)
imports it from there and the trainer imports this client, which the layering allows (rl may
import envs). Moving
the module was chosen over injecting a client factory into the harness eval: the client is
plain grpc with no dependency on the engine, and `--mode=eval` needs no caller to build it.
"""
import dataclasses
import functools
import itertools
from typing import Optional, Sequence

import grpc

from envs import jetstream_wire


class EngineError(RuntimeError):
  """The server refused or failed a request; `code` is the gRPC status code."""

  def __init__(self, code, details: str):
    super().__init__(f"{code.name if code is not None else 'UNKNOWN'}: {details}")
    self.code = code
    self.details = details


@dataclasses.dataclass
class Generation:
  ids: list
  logprobs: list
  finish_reason: str
  weights_version: int = 0


class TokenClient:
  """Sync client of the extended JetStream Decode RPC.

  Args:
    address: "host:port" of the rollout server.
    timeout_s: deadline of one generate call.
  """

  def __init__(self, address: str, timeout_s: float = 600.0):
    self.address = address
    self.timeout_s = timeout_s
    self._channel = grpc.insecure_channel(address, options=[
        ("grpc.max_receive_message_length", 64 << 20)])
    self._decode = self._channel.unary_stream(
        jetstream_wire.DECODE_METHOD, request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=jetstream_wire.DecodeResponse.FromString)

  def request(self, prompt_ids: Sequence[int], sampling=None, max_tokens: int = 16,
              stop_ids: Optional[Sequence[int]] = None):
    """The extended DecodeRequest. sampling: any object with temperature/top_p/top_k/seed."""
    req = jetstream_wire.DecodeRequest(max_tokens=int(max_tokens))
    req.token_content.token_ids.extend(int(i) for i in prompt_ids)
    if sampling is not None:
      req.sampling.temperature = float(sampling.temperature)
      req.sampling.top_p = float(sampling.top_p)
      req.sampling.top_k = int(sampling.top_k)
      if sampling.seed is not None:
        req.sampling.has_seed = True
        req.sampling.seed = int(sampling.seed) & 0xFFFF_FFFF_FFFF_FFFF
    if stop_ids is not None:
      req.has_stop_ids = True
      req.stop_ids.extend(int(i) for i in stop_ids)
    return req

  def stream(self, prompt_ids, sampling=None, max_tokens: int = 16, stop_ids=None,
             timeout_s: Optional[float] = None):
    """The raw response stream (a grpc call object: iterate it, `.cancel()` it)."""
    return self._decode(self.request(prompt_ids, sampling, max_tokens, stop_ids),
                        timeout=timeout_s or self.timeout_s)

  def generate(self, prompt_ids, sampling=None, max_tokens: int = 16, stop_ids=None,
               timeout_s: Optional[float] = None) -> Generation:
    ids, lps, finish, version = [], [], "", 0
    try:
      for resp in self.stream(prompt_ids, sampling, max_tokens, stop_ids, timeout_s):
        for s in resp.stream_content.samples:
          ids.extend(s.token_ids)
          lps.extend(s.logprobs)
          if s.finish_reason:
            finish, version = s.finish_reason, s.weights_version
    except grpc.RpcError as e:
      raise EngineError(e.code(), e.details()) from None
    if not finish:
      raise EngineError(None, f"stream ended without a finish reason after {len(ids)} tokens")
    return Generation(ids, lps, finish, version)

  def health(self, timeout_s: float = 5.0) -> bool:
    """True when the server answers JetStream's HealthCheck as live."""
    call = self._channel.unary_unary(jetstream_wire.HEALTH_METHOD,
                                     request_serializer=lambda m: b"",
                                     response_deserializer=lambda b: b)
    try:
      out = call(None, timeout=timeout_s)
    except grpc.RpcError:
      return False
    return out == b"\x08\x01"  # HealthCheckResponse{is_live: true}

  def close(self):
    self._channel.close()


class JetStreamPolicy:
  """envs.harness Policy over one or more rollout servers: generate(...) -> (ids, logprobs,
  finish). With several, requests go round-robin (every server serves the same weights
  version; rl/rollout/published_weights.py)."""

  def __init__(self, *clients: TokenClient):
    if not clients:
      raise ValueError("JetStreamPolicy needs at least one TokenClient")
    self.clients = clients
    self._next = itertools.cycle(clients)

  def generate(self, prompt_ids, sampling, max_tokens, stop_ids):
    out = next(self._next).generate(prompt_ids, sampling, max_tokens, stop_ids)
    return out.ids, out.logprobs, out.finish_reason


def server_addresses(config) -> tuple:
  """Where rollouts go: rollout.servers (separate jobs) or else rollout.address."""
  return tuple(config.rollout.servers) or (config.rollout.address,)


def jetstream_policy_factory(config):
  """A picklable `ChatFormat -> Policy` factory for the harness pool (harness.policy_backend=jetstream)."""
  return functools.partial(_build_policy, server_addresses(config),
                           float(config.rollout.client_timeout_s))


def _build_policy(addresses, timeout_s, fmt):
  del fmt
  return JetStreamPolicy(*(TokenClient(a, timeout_s) for a in addresses))
