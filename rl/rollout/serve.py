"""`python launch.py --mode=serve --config=configs/tiny_cpu.py --port=9000`.

Builds the Qwen3.5 engine from the config (random init; params come later by weight sync or
`build_server(params=...)`), compiles its prefill buckets, and serves JetStream's
Orchestrator gRPC service (token and text requests) until interrupted.
"""
from typing import Optional


def build_server(config, params=None, port: Optional[int] = None, warmup: Optional[bool] = None):
  """An engine + JetStream Driver + gRPC server for `config`, started. Returns RolloutServer."""
  from rl.rollout import compat  # pylint: disable=g-import-not-at-top
  from rl.rollout.engine import QwenEngine  # pylint: disable=g-import-not-at-top
  from rl.rollout.orchestrator import RolloutServer  # pylint: disable=g-import-not-at-top
  compat.set_log_level(config.rollout.log_level)
  engine = QwenEngine.from_config(config, params=params)
  if config.rollout.warmup if warmup is None else warmup:
    engine.warmup()
  port = config.rollout.port if port is None else port
  return RolloutServer(engine, port=port, threads=config.rollout.rpc_threads or None).start()


def main(config, flags=None):
  from rl.rollout import capacity  # pylint: disable=g-import-not-at-top
  port = getattr(flags, "port", None) if flags is not None else None
  p = capacity.plan_from_config(config)
  print(f"capacity: {p.bytes_per_seq / 2**20:.2f} MiB decode state per sequence at "
        f"{p.context_len} tokens; {p.per_engine} sequences fit this engine; "
        f"slots = {capacity.engine_slots(config)}", flush=True)
  server = build_server(config, port=port)
  print(f"serving on {server.address} (slots {server.engine.slots}, max_len "
        f"{server.engine.max_len}, buckets {server.engine.buckets})", flush=True)
  try:
    server.wait_for_termination()
  except KeyboardInterrupt:
    server.stop()
