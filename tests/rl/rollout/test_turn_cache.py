"""The turn cache: a conversation's next prompt continues its last turn's kept slot state."""
import os
import sys
import threading

import jax
import numpy as np
import pytest

from envs.harness.policy import SamplingParams
from models import qwen3_5
from rl.rollout.engine import PrefillInput
from rl.rollout.engine import SamplingSettings
from rl.rollout.turn_cache import TurnCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from greedy_reference import greedy_by_recompute, one_device_and_sharded_engines, tiny_server  # noqa: E402,E501

MAX_LEN = 256
SYSTEM = list(range(600, 700))
GREEDY = SamplingParams(temperature=0.0)


def test_take_returns_the_longest_kept_turn_a_prompt_extends_and_removes_it():
  turns = TurnCache(capacity=4)
  turns.keep([1, 2, 3], 0, "short")
  turns.keep([1, 2, 3, 4, 5], 0, "long")
  turns.keep([1, 9], 0, "other")
  assert turns.take([1, 2, 3, 4, 5, 6], version=0) == (5, "long")
  assert turns.take([1, 2, 3, 4, 5, 6], version=0) == (3, "short")   # taken once each
  assert turns.take([1, 2, 3, 4, 5, 6], version=0) is None
  assert turns.take([1, 9], version=0) is None    # the same tokens: nothing new to prefill
  assert turns.stats() == dict(kept=3, hits=2, misses=2, stale=0, evicted=0, held=1)


def test_a_turn_kept_under_other_weights_is_not_used():
  turns = TurnCache(capacity=2)
  turns.keep([1, 2], np.int32(-1), "mixed")     # the weights changed while it was decoded
  turns.keep([3, 4], np.int32(0), "old")
  assert turns.take([1, 2, 5], version=0) is None
  assert turns.take([3, 4, 5], version=1) is None
  assert turns.stats()["stale"] == 2 and len(turns) == 0


def test_the_oldest_turns_give_way_past_capacity():
  turns = TurnCache(capacity=2)
  for i in range(3):
    turns.keep([i, i], 0, i)
  assert turns.take([0, 0, 1], 0) is None and turns.take([2, 2, 1], 0) == (2, 2)
  assert turns.stats()["evicted"] == 1


@pytest.fixture(scope="module")
def server():
  with tiny_server(MAX_LEN, prefix_cache=True, prefix_buckets=(32, 64, 128), prefix_min_len=64,
                   turn_cache=4) as served:
    yield served


def _reference(cfg, params, prompt, n):
  return greedy_by_recompute(cfg, params, prompt, n, MAX_LEN)


def _stop_after(ids, at_least: int):
  """A stop id that ends `ids` at its first occurrence, after at least `at_least` tokens."""
  for i in range(at_least, len(ids)):
    if ids[i] not in ids[:i]:
      return ids[i], i + 1
  return None, len(ids)


def test_turns_continued_from_kept_state_match_full_recompute_while_other_slots_decode(server):
  """Two conversations of three turns; between their turns a long request keeps the decode
  loop stepping, so a finished slot that did not hold still would be several tokens past its
  turn by the time the next turn comes. One conversation's turns end at a stop id, the
  other's at max_tokens."""
  s, client, cfg, params = server
  before = s.engine.turn_cache_stats()
  busy = threading.Thread(target=lambda: client.generate(list(range(50, 90)), GREEDY,
                                                         max_tokens=150, stop_ids=[]))
  busy.start()
  for k, use_stop in enumerate((True, False)):
    prompt = SYSTEM + [5 + k, 17, 300]
    for turn in range(3):
      want = _reference(cfg, params, prompt, 8)
      stop, n = _stop_after(want, 2) if use_stop else (None, 8)
      out = client.generate(prompt, GREEDY, max_tokens=8, stop_ids=[stop] if stop else [])
      assert out.ids == want[:n], (k, turn)
      prompt = prompt + out.ids + [40 + turn, 41, 42 + k]
  busy.join()
  after = s.engine.turn_cache_stats()
  assert after["hits"] - before["hits"] == 4    # every turn after the first
  assert after["stale"] == before["stale"] and after["mismatched"] == 0


def test_a_weight_sync_between_turns_prefills_the_next_turn_whole(server):
  s, client, cfg, old = server
  new = qwen3_5.init_params(cfg, jax.random.key(99))
  prompt = SYSTEM + [8, 8, 300]
  out = client.generate(prompt, GREEDY, max_tokens=6, stop_ids=[])
  prompt = prompt + out.ids + [40, 41]
  before = s.engine.turn_cache_stats()
  try:
    s.update_weights(new)
    out = client.generate(prompt, GREEDY, max_tokens=6, stop_ids=[])
    assert out.ids == _reference(cfg, new, prompt, 6)   # the old weights' state would differ
    assert out.ids != _reference(cfg, old, prompt, 6)
    after = s.engine.turn_cache_stats()
    assert after["hits"] == before["hits"] and after["held"] == 0
  finally:
    s.update_weights(old)


def test_sharded_engine_continues_a_kept_turn_as_one_device_prefills_the_whole():
  """Through the engine API on a 2x2x2 mesh: a turn decoded in slot 1 and stepped past its last
  token (as JetStream's loop does while other slots decode), kept, and continued; its logits
  match a one-device engine prefilling the whole conversation."""
  whole, sharded = one_device_and_sharded_engines(MAX_LEN, 192, prefix_buckets=(64,),
                                                  turn_cache=2)
  greedy = SamplingSettings(temperature=0.0, seed=3)

  def prefill(engine, prompt, max_tokens=0):
    padded = np.zeros((192,), np.int32)
    padded[:len(prompt)] = prompt
    return engine.prefill(params=engine.load_params(), true_length=len(prompt),
                          padded_tokens=PrefillInput(padded, greedy, (), max_tokens))

  prompt = SYSTEM + [5, 17, 300]
  state = sharded.insert(prefill(sharded, prompt, max_tokens=4), sharded.init_decode_state(), 1)
  reply = []
  for _ in range(7):   # 4 tokens of the request, then 3 steps with the slot finished
    state, result = sharded.generate(sharded.load_params(), state)
    reply.append(int(np.asarray(result.data)[1, 0]))
  sharded.keep_turn(1, prompt + reply[:4])
  nxt = prompt + reply[:4] + [40, 41, 42]
  before = sharded.prefilled_tokens
  continued = prefill(sharded, nxt)
  assert sharded.turn_cache_stats()["hits"] == 1
  assert sharded.prefilled_tokens - before == 3   # only the tokens after the kept turn
  np.testing.assert_allclose(continued["logits"], prefill(whole, nxt)["logits"], atol=1e-4)
