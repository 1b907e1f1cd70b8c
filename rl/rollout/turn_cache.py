"""Finished conversation turns whose decode state the next turn continues from.

An agent's next prompt is its last prompt, the reply it sampled and the tool's output: without
reuse the engine prefills all of it again at every turn (after the shared system turn, which
rl/rollout/prefix_cache.py caches), so an episode of n turns prefills O(n^2) tokens. When a
request ends, its slot already holds the state of every token of the conversation so far (the
prompt, and each sampled token, the last one included: `generate` feeds each token through the
model as it samples it). `TurnCache` keeps that state, keyed by those tokens, and the next
prompt that extends them takes it and prefills only what is new (`qwen3_5.prefill_append`).

* An entry is taken once: a conversation continues once; its next turn is kept when it ends.
* An entry holds the weights version its state was computed with (-1 when the weights changed
  while the request ran); a prompt under other weights does not use it (on-policy: the next
  turn's logprobs are the current weights', every token of them).
* At most `capacity` entries, least recently kept dropped first: each holds one slot's cache.
"""
import collections
import threading
from typing import Any, Optional

import numpy as np


class TurnCache:
  """Kept turns: tokens -> (weights version, one slot's cache). Thread-safe."""

  def __init__(self, capacity: int):
    if capacity < 1:
      raise ValueError(f"turn cache capacity must be >= 1, got {capacity}")
    self.capacity = int(capacity)
    self._lock = threading.Lock()
    self._entries: "collections.OrderedDict[int, tuple[np.ndarray, Any, Any]]" = (
        collections.OrderedDict())
    self._next_key = 0
    self.kept = 0
    self.hits = 0
    self.misses = 0
    self.stale = 0      # a prompt extended an entry computed under other weights
    self.evicted = 0

  def __len__(self) -> int:
    with self._lock:
      return len(self._entries)

  def keep(self, tokens, version, cache) -> None:
    """Keeps the state `cache` of `tokens` computed under weights `version` (an int or a device
    scalar, read when the entry is taken)."""
    tokens = np.asarray(tokens, np.int32)
    with self._lock:
      self._entries[self._next_key] = (tokens, version, cache)
      self._next_key += 1
      self.kept += 1
      while len(self._entries) > self.capacity:
        self._entries.popitem(last=False)
        self.evicted += 1

  def take(self, prompt, version: int) -> Optional[tuple[int, Any]]:
    """(tokens the kept state holds, the state) for the longest entry `prompt` extends by at
    least one token under weights `version`, removed from the cache; None if there is none."""
    prompt = np.asarray(prompt, np.int32)
    with self._lock:
      best = None
      for key, (tokens, _, _) in self._entries.items():
        n = len(tokens)
        if (n < len(prompt) and prompt[n - 1] == tokens[-1] and (best is None or n > best[1])
            and np.array_equal(prompt[:n], tokens)):
          best = (key, n)
      if best is None:
        self.misses += 1
        return None
      _, entry_version, cache = self._entries.pop(best[0])
    if int(entry_version) != int(version):
      with self._lock:
        self.stale += 1
      return None
    with self._lock:
      self.hits += 1
    return best[1], cache

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()

  def stats(self) -> dict:
    with self._lock:
      return dict(kept=self.kept, hits=self.hits, misses=self.misses, stale=self.stale,
                  evicted=self.evicted, held=len(self._entries))
