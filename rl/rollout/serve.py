"""`python launch.py --mode=serve --config=configs/tiny_cpu.py --port=9000`.

Builds the Qwen3.5 engine from the config with the weights `--weights` names (`load_weights`):
by default the config's checkpoint, `train.init_from` (configs/tiny_cpu.py: the shipped
assets/tiny_base); `--weights=DIR` another Hugging Face checkpoint directory; `--weights=random`
the seeded random init, only when asked (a config with no checkpoint and no --weights is
refused). It prints which weights it serves, compiles its programs, and serves JetStream's
Orchestrator gRPC service (token and text requests) until interrupted. With
`rollout.weights_dir` set, it serves the versions a trainer in another job publishes there
(rl/rollout/published_weights.py), version -1 (the start weights: the checkpoint, or a random
init where the config names none) until the first arrives.
With `--http_port=P` it also serves an OpenAI-compatible HTTP API on P (rl/rollout/openai_http.py,
docs/openai_endpoint.md), on the same engine slots.

Ctrl-C or SIGTERM stops it within seconds, under load too: every request accepted and not yet
answered ends with an error (gRPC UNAVAILABLE; HTTP 503, or a stream's error event then
[DONE]), then both fronts close, and the process exits with code 0. A second signal while it
stops ends the process at once.
"""
import contextlib
import os
import signal
import tempfile
import threading
import time
from typing import Optional, Sequence

import jax

from configs.validate import ConfigError
from envs.apps import gateway
from envs.apps import shell_tools
from envs.chat import ChatFormat
from envs.chat import tokenizer as chat_tokenizer
from envs.harness import tool_subset
from models import qwen3_5
from models import sharding
from rl import params_io
from rl.rollout import capacity
from rl.rollout import published_weights

RANDOM_WEIGHTS = "random"  # --weights=random: serve the seeded random init


def build_server(config, params=None, port: Optional[int] = None, warmup: Optional[bool] = None,
                 warmup_prefix: Optional[Sequence[int]] = None, warmup_score: bool = False,
                 **engine_overrides):
  """An engine + JetStream Driver + gRPC server for `config`, started. Returns RolloutServer.
  `engine_overrides` go to QwenEngine.from_config (e.g. initial_version). With warmup
  (default `rollout.warmup`), `warmup_prefix` (ids prompts open with, `system_turn`) and
  `warmup_score` (the HTTP front's echo) go to `QwenEngine.warmup`."""
  # JetStream loads only when a server is built: a trainer imports build_server but, with
  # rollout.servers set, serves from separate jobs and never builds one.
  from rl.rollout import compat  # lazy: JetStream, only when a server is built
  from rl.rollout.engine import QwenEngine  # lazy: JetStream, only when a server is built
  from rl.rollout.orchestrator import RolloutServer  # lazy: JetStream, only when a server is built
  compat.set_log_level(config.rollout.log_level)
  engine = QwenEngine.from_config(config, params=params, **engine_overrides)
  if config.rollout.warmup if warmup is None else warmup:
    engine.warmup(prefix=warmup_prefix, score=warmup_score)
  port = config.rollout.port if port is None else port
  return RolloutServer(engine, port=port, threads=config.rollout.rpc_threads or None).start()


def load_weights(config, weights: str = "") -> tuple:
  """(params, what) that `--mode=serve` starts from; params None = the seeded random init (the
  engine draws it on its own devices).

  `weights`: "" = the config's checkpoint (`train.init_from`, a Hugging Face directory); a
  directory = that checkpoint; "random" = the random init. A config with no checkpoint serves
  a random init only where asked (or, with `rollout.weights_dir`, as the placeholder until a
  trainer publishes); otherwise ConfigError. A checkpoint is read straight into the shards of
  the engine's mesh when it has one.
  """
  until = (f", until the first version published in {config.rollout.weights_dir}"
           if config.rollout.weights_dir else "")
  if weights == RANDOM_WEIGHTS:
    return None, f"a random init (seed {config.seed}; --weights=random){until}"
  path = weights or config.train.init_from
  if not path:
    if config.rollout.weights_dir:
      return None, f"a random init (seed {config.seed}; train.init_from is empty){until}"
    raise ConfigError("--mode=serve: no weights to serve: train.init_from is empty. Pass "
                      "--weights=DIR (a Hugging Face checkpoint directory), set "
                      "--config.train.init_from=DIR, or --weights=random for the seeded "
                      "random init")
  from rl.rollout.engine import engine_mesh  # lazy: JetStream, only when a server is built
  mesh, rules = engine_mesh(config)
  shardings = None
  if mesh is not None:
    cfg = qwen3_5.config_from_dict(config.model)
    shapes = jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0)))
    shardings = sharding.tree_shardings(qwen3_5.param_axes(cfg), shapes, mesh, rules)
  try:
    params = params_io.init_params(config, shardings, path=path)
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(f"--mode=serve: {e}") from e
  source = "--weights" if weights else "train.init_from"
  return params, f"{os.path.abspath(path)} ({source}){until}"


def served_tools(config) -> Optional[tuple]:
  """(tools, system prompt) the config's worlds show the policy: the app or shell tools of
  harness.style, cut to loop.tools and loop.tool_schema, in the OpenAI function shape, as the
  harness lists them. None where they are not known before a world starts (envs.source other
  than "generated": an external MCP server's tools)."""
  if config.envs.source != "generated":
    return None
  style = config.harness.style
  with tempfile.TemporaryDirectory() as d:
    for sub in ("files", "apps"):
      os.makedirs(os.path.join(d, sub))
    listed = gateway.LocalGateway(d, config.envs, style).list_tools()

  class Listed:   # the world as tool_subset sees it
    def __init__(self):
      self.style = style

    def tools(self):
      return [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in listed]
  tools = tool_subset.ToolSubsetWorld(Listed(), config.loop.tools,
                                      config.loop.tool_schema).tools()
  return tools, shell_tools.SYSTEM_PROMPT if style == "shell" else ""


def system_turn(config) -> Optional[list]:
  """The ids every prompt of the config's episodes opens with: the system turn of
  `served_tools`, as the harness renders it and as an OpenAI chat client sending those tools
  gets it. None where the tools are not known before a world starts."""
  served = served_tools(config)
  if served is None:
    return None
  fmt = ChatFormat(chat_tokenizer.from_config(config.tokenizer), bool(config.tokenizer.thinking))
  return fmt.system_ids(*served)


def start_http(server, config, port: int):
  """The OpenAI-compatible HTTP front of `server` on `port` (0 = any free port), started."""
  from rl.rollout import openai_http  # lazy: JetStream and uvicorn, only when a server is built
  return openai_http.OpenAIFront(server, config, port=port).start()


@contextlib.contextmanager
def _signals_stop_serving():
  """Within: SIGINT and SIGTERM raise KeyboardInterrupt in the main thread (the serve loop's
  stop), and after the first either signal takes its default action (a second Ctrl-C or
  SIGTERM ends a stop that hangs). A signal the process was started with ignored stays
  ignored (`nohup`, a background job without job control). Yields a list that receives the
  (signal name, monotonic time) of the first. Off the main thread (signals cannot be set
  there), nothing changes."""
  got = []
  if threading.current_thread() is not threading.main_thread():
    yield got
    return
  wanted = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
  before = {s: signal.getsignal(s) for s in wanted}

  def stop(signum, frame):
    del frame
    got.append((signal.Signals(signum).name, time.monotonic()))
    for s in ours:
      signal.signal(s, signal.SIG_DFL)
    raise KeyboardInterrupt(signal.Signals(signum).name)

  ours = [s for s, default in wanted.items() if before[s] is default]
  for s in ours:
    signal.signal(s, stop)
  try:
    yield got
  finally:
    for s in ours:
      signal.signal(s, before[s])


def main(config, flags=None):
  port = getattr(flags, "port", None) if flags is not None else None
  http_port = getattr(flags, "http_port", None) if flags is not None else None
  capacity.check_context(config)
  p = capacity.plan_from_config(config)
  print(f"capacity: {p.bytes_per_seq / 2**20:.2f} MiB decode state per sequence at "
        f"{p.context_len} tokens; {p.per_engine} sequences fit this engine; "
        f"slots = {capacity.engine_slots(config)}", flush=True)
  weights_dir = config.rollout.weights_dir
  params, what = load_weights(config, getattr(flags, "weights", "") or "")
  print(f"serving weights: {what}", flush=True)
  # Warmup compiles what the first requests would: the prefix-cache programs of the system
  # turn the served tools give, and with the HTTP front the echo's scoring programs.
  prefix = system_turn(config) if config.rollout.warmup and config.rollout.prefix_cache else None
  server = build_server(config, params=params, port=port, warmup_prefix=prefix,
                        warmup_score=http_port is not None,
                        initial_version=published_weights.UNLOADED if weights_dir else 0)
  front = start_http(server, config, http_port) if http_port is not None else None
  watcher = None
  if weights_dir:
    watcher = published_weights.WeightWatcher(weights_dir, server.engine,
                                              config.rollout.weights_poll_s).start()
  print(f"serving on {server.address} (slots {server.engine.slots}, max_len "
        f"{server.engine.max_len}, buckets {server.engine.buckets})"
        + (f"; weights from {watcher.weights_dir}" if watcher else "")
        + (f"; OpenAI-compatible HTTP on port {front.port} ({front.url}, model "
           f"{front.model_name!r})" if front else ""), flush=True)
  with _signals_stop_serving() as got:
    try:
      server.wait_for_termination()
    except KeyboardInterrupt:
      pass
    finally:
      # The server first: it ends every open request with an error (HTTP's included), so the
      # front then closes connections that are all answered.
      server.stop()
      if front is not None:
        front.stop()
      if watcher is not None:
        watcher.stop()
    if got:
      print(f"stopped {time.monotonic() - got[0][1]:.2f} s after {got[0][0]}", flush=True)
