"""A running rollout server and its token client, for the module-scoped fixtures of the server
tests (tests/rl/rollout/test_rollout_server.py, test_engine_lora.py)."""
from envs.harness.jetstream_client import TokenClient
from rl.rollout import serve


def running_server(config, params):
  """Yields a server of `params` on a free port, warmed for prompts of up to 16 tokens; stops it."""
  s = serve.build_server(config, params=params, port=0, warmup=False)
  s.engine.warmup(buckets=(16,))
  yield s
  s.stop()


def running_client(server):
  """Yields a token client of `server`; closes it."""
  c = TokenClient(server.address, timeout_s=120)
  yield c
  c.close()
