"""The shared-prefix cache: what it learns, and that prompts served from it match the model."""
import os
import sys

import jax
import numpy as np
import pytest

from envs.harness.policy import SamplingParams
from models import qwen3_5
from models.layers import gated_deltanet
from rl.rollout.engine import PrefillInput
from rl.rollout.engine import SamplingSettings
from rl.rollout.prefix_cache import SharedPrefix

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from greedy_reference import greedy_by_recompute, one_device_and_sharded_engines, tiny_server  # noqa: E402,E501

MAX_LEN = 256
SYSTEM = list(range(600, 700))                   # 100 tokens every prompt opens with
TAILS = [[5, 17, 300, 41], list(range(200, 240)), [11], [900, 3, 3, 77, 12, 640, 8]]
GREEDY = SamplingParams(temperature=0.0)


def _ids(*parts):
  return np.asarray([t for p in parts for t in p], np.int32)


def test_learns_the_common_prefix_of_two_prompts_rounded_down_to_the_alignment():
  shared = SharedPrefix(align=16, min_len=32)
  assert shared.match(_ids(SYSTEM, [1, 2])) == 0          # nothing to compare with yet
  assert shared.match(_ids(SYSTEM, [3, 4, 5])) == 96       # 100 shared -> 96
  assert shared.match(_ids(SYSTEM, [7])) == 96
  assert (shared.hits, shared.misses) == (1, 2)


def test_the_same_prompt_twice_teaches_nothing():
  shared = SharedPrefix(align=16, min_len=32)
  for _ in range(3):   # the samples of one group
    assert shared.match(_ids(SYSTEM, TAILS[1])) == 0
  assert shared.tokens is None


def test_a_prefix_learned_inside_one_conversation_gives_way_to_the_one_all_share():
  shared = SharedPrefix(align=16, min_len=32)
  turn1 = _ids(SYSTEM, TAILS[1])
  turn2 = _ids(SYSTEM, TAILS[1], [2] * 30)                 # the same episode, one turn later
  shared.match(turn1)
  assert shared.match(turn2) == 128                        # 140 shared: too specific
  assert shared.match(_ids(SYSTEM, TAILS[0])) == 96        # another episode misses it: relearned
  for tail in TAILS:
    assert shared.match(_ids(SYSTEM, tail, [9])) == 96     # and it stays
  assert len(shared.tokens) == 96


def test_prefix_shorter_than_min_len_is_not_cached():
  shared = SharedPrefix(align=16, min_len=128)
  shared.match(_ids(SYSTEM, [1]))
  assert shared.match(_ids(SYSTEM, [2])) == 0 and shared.tokens is None


def test_cache_is_computed_once_per_weights_version():
  shared = SharedPrefix(align=16, min_len=32)
  shared.match(_ids(SYSTEM, [1]))
  n = shared.match(_ids(SYSTEM, [2]))
  calls = []
  compute = lambda t: calls.append(len(t)) or len(calls)
  prefix = shared.tokens
  assert [shared.cache_for(0, prefix, compute) for _ in range(3)] == [1, 1, 1]
  assert shared.cache_for(1, prefix, compute) == 2
  assert calls == [n, n]


@pytest.fixture(scope="module")
def server():
  with tiny_server(MAX_LEN, prefix_cache=True, prefix_buckets=(32, 64, 128),
                   prefix_min_len=64) as served:
    yield served


def _greedy_by_recompute(cfg, params, prompt, n):
  return greedy_by_recompute(cfg, params, prompt, n, MAX_LEN)


def test_prompts_served_after_the_shared_prefix_match_full_recompute(server):
  s, client, cfg, params = server
  prompts = [list(_ids(SYSTEM, t)) for t in TAILS] + [list(range(50, 90))]  # the last shares nothing
  for prompt in prompts:
    out = client.generate(prompt, GREEDY, max_tokens=6, stop_ids=[])
    assert out.ids == _greedy_by_recompute(cfg, params, prompt, 6), prompt
  stats = s.engine.prefix_cache_stats()
  # The shared prefix: the prompts' common tokens, cut to whole GDN chunks.
  common = next(i for i, col in enumerate(zip(*prompts[:-1])) if len(set(col)) > 1)
  chunk = gated_deltanet.chunk_size(cfg)
  assert common >= 64 and stats["prefix_len"] == common // chunk * chunk
  assert stats["hits"] == 2 and stats["computes"] == 1   # tails 3 and 4; the 2nd learned it


def test_weight_sync_recomputes_the_shared_prefix(server):
  s, client, cfg, old = server
  new = qwen3_5.init_params(cfg, jax.random.key(99))
  before = s.engine.prefix_cache_stats()["computes"]
  prompt = list(_ids(SYSTEM, TAILS[3]))
  try:
    s.update_weights(new)
    out = client.generate(prompt, GREEDY, max_tokens=6, stop_ids=[])
    assert out.ids == _greedy_by_recompute(cfg, new, prompt, 6)   # a stale prefix would differ
    assert out.ids != _greedy_by_recompute(cfg, old, prompt, 6)
    assert s.engine.prefix_cache_stats()["computes"] == before + 1
  finally:
    s.update_weights(old)


def test_sharded_engine_serves_the_shared_prefix_as_one_device_prefills_whole():
  whole, sharded = one_device_and_sharded_engines(MAX_LEN, 192, prefix_buckets=(128,),
                                                  prefix_min_len=64)
  for tail in TAILS:
    prompt = _ids(SYSTEM, tail)
    outs = []
    for e in (whole, sharded):
      padded = np.zeros((192,), np.int32)
      padded[:len(prompt)] = prompt
      outs.append(e.prefill(params=e.load_params(), true_length=len(prompt),
                            padded_tokens=PrefillInput(padded, SamplingSettings(seed=3))))
    np.testing.assert_allclose(outs[1]["logits"], outs[0]["logits"], atol=1e-4)
  assert sharded.prefix_cache_stats()["hits"] == 2
