"""The prompt prefix that requests share, learned from the prompts themselves.

Every agent prompt opens with the same system turn (the tool schemas: ~700 tokens for the tiny
default, thousands with every tool), and the engine would prefill it again for every turn of
every episode. `SharedPrefix` finds that prefix without being told: when a prompt does not
extend the current prefix, the longest common prefix of it and the previous such prompt
(rounded down to `align` tokens) becomes the prefix, if it is at least `min_len` long. A prefix
learned from two turns of one conversation (too specific) is replaced at the next prompt of
another conversation, since that one misses it; the system turn, once learned, is never
missed by a prompt that has it, so it stays.

The engine keeps the prefix's cache for one weights version and recomputes it (one prefill of
the prefix) at the first request after a weight sync.
"""
import threading
from typing import Any, Callable, Optional

import numpy as np


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
  """Number of leading tokens `a` and `b` share."""
  n = min(len(a), len(b))
  differ = np.flatnonzero(a[:n] != b[:n])
  return int(differ[0]) if len(differ) else n


class SharedPrefix:
  """The learned prefix and its cache (for one weights version). Thread-safe."""

  def __init__(self, align: int, min_len: int):
    if align < 1 or min_len < 1:
      raise ValueError(f"prefix cache align and min_len must be >= 1, got {align}, {min_len}")
    self.align = int(align)
    self.min_len = int(min_len)
    self._lock = threading.Lock()
    self._tokens: Optional[np.ndarray] = None    # the prefix [P] int32
    self._last_miss: Optional[np.ndarray] = None  # the last prompt that did not extend it
    self._cache: Optional[tuple[int, Any]] = None  # (weights version, the prefix's cache)
    self.hits = 0
    self.misses = 0
    self.computes = 0

  @property
  def tokens(self) -> Optional[np.ndarray]:
    return self._tokens

  def match(self, prompt: np.ndarray) -> int:
    """Length of the prefix `prompt` extends (by at least one token), or 0. A miss may learn a
    new prefix from this prompt and the last one that missed, which this prompt then uses."""
    prompt = np.asarray(prompt, np.int32)
    with self._lock:
      p = self._tokens
      if p is not None and len(prompt) > len(p) and np.array_equal(prompt[:len(p)], p):
        self.hits += 1
        return len(p)
      self.misses += 1
      last, self._last_miss = self._last_miss, prompt
      # The same prompt twice (samples of one group) says nothing about what others share.
      if last is None or np.array_equal(last, prompt):
        return 0
      n = min(common_prefix_len(last, prompt), len(last) - 1, len(prompt) - 1)
      n -= n % self.align
      if n < self.min_len:
        return 0
      self._tokens, self._cache = prompt[:n].copy(), None
      return n

  def prime(self, tokens) -> int:
    """Takes `tokens` (cut to `align`) as the prefix before any prompt is seen: what the
    server knows prompts will open with (the system turn of its tools), so that the first
    prompts hit it and its programs can be compiled at warmup. Returns its length (0 when
    shorter than `min_len`: nothing changes). A prompt that does not extend it still teaches a
    new prefix, as after any prefix."""
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens) - len(tokens) % self.align
    if n < self.min_len:
      return 0
    with self._lock:
      self._tokens, self._cache = tokens[:n].copy(), None
    return n

  def cache_for(self, version: int, tokens: np.ndarray, compute: Callable[[np.ndarray], Any]):
    """The cache of prefix `tokens` under weights `version`, computed by `compute(tokens)` once
    per version (and again if the prefix changed meanwhile)."""
    with self._lock:
      held = self._cache
      current = self._tokens is not None and np.array_equal(self._tokens, tokens)
    if held is not None and held[0] == version and current:
      return held[1]
    cache = compute(tokens)
    with self._lock:
      self.computes += 1
      if self._tokens is not None and np.array_equal(self._tokens, tokens):
        self._cache = (version, cache)
    return cache
