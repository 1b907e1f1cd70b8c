"""Warmup compiles every program the server runs: after `QwenEngine.warmup` (with the system
turn of the served tools and the echo's scoring), a burst of every kind of request compiles
nothing more."""
import concurrent.futures

import numpy as np
import openai
import pytest

from configs import tiny_cpu
from envs import tasks as tasks_lib
from rl import params_io
from rl.rollout import serve

PROGRAMS = ("prefill", "extend", "insert", "generate", "score")   # EnginePrograms' jits


@pytest.fixture(scope="module")
def config():
  c = tiny_cpu.get_config()
  c.unlock()
  c.rollout.slots = 4
  c.rollout.max_len = 1280
  c.train.max_context = 1280
  c.rollout.prefill_buckets = (256, 1024)
  c.rollout.prefix_buckets = (128, 512)
  return c


def _ids(n: int) -> list:
  """`n` ordinary ids, a draw of their own: prompts that share no prefix (two that did would
  teach the engine a new shared prefix, whose programs no warmup can know)."""
  return [int(i) for i in np.random.default_rng(n).integers(30, 900, n)]


def _compiled(engine) -> dict:
  """Program name -> how many compiled variants jit holds for it."""
  return {name: getattr(engine.programs, name)._cache_size() for name in PROGRAMS}


def test_after_warmup_a_burst_of_every_kind_of_request_compiles_nothing(config):
  prefix = serve.system_turn(config)
  server = serve.build_server(config, params=params_io.init_params(config), port=0,
                              warmup=True, warmup_prefix=prefix, warmup_score=True)
  front = serve.start_http(server, config, port=0)
  try:
    engine = server.engine
    warm = _compiled(engine)
    # Every program was compiled: the extension of the system turn by each prefix bucket, and
    # an insert of each prefill into a new and into a used decode state.
    assert warm["extend"] == len(config.rollout.prefix_buckets)
    assert warm["score"] == len(engine.buckets)
    assert engine.prefix_cache_stats()["prefix_len"] == len(prefix) - len(prefix) % 64 > 0
    api = openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=300)
    tools = serve.served_tools(config)[0]
    tasks = tasks_lib.load_split(config.envs, "eval")
    model = config.name
    calls = []
    for i in range(4):   # the tools' system turn then a task: short and long rests
      content = tasks[i].prompt + (" Explain every step in detail." * 20 if i % 2 else "")
      calls.append(lambda c=content, i=i: api.chat.completions.create(
          model=model, messages=[{"role": "user", "content": c}], tools=tools, max_tokens=8,
          seed=i))
    calls += [lambda n=n: api.completions.create(model=model, prompt=_ids(n),
                                                 max_tokens=8, seed=n)
              for n in (5, 300, 1100)]   # each prefill bucket, the largest (max_len - 1) too
    calls += [lambda: api.chat.completions.create(model=model, max_tokens=8, messages=[
        {"role": "user", "content": "hello"}])]
    calls += [lambda n=n: api.completions.create(model=model, prompt=_ids(n),
                                                 max_tokens=0, echo=True, logprobs=1)
              for n in (5, 300)]
    for _ in range(2):
      with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        for f in [pool.submit(c) for c in calls]:
          f.result()
    assert engine.prefix_cache_stats()["hits"] >= 8   # the chats extended the primed prefix
    assert _compiled(engine) == warm
  finally:
    front.stop()
    server.stop()
