"""The prompt caches of a QwenEngine (rl/rollout/engine.py): the shared prefix and kept turns.

Both let `prefill` start a prompt from a state computed before and run only the tokens after
it. `EngineCaches` keeps their bookkeeping: which cached state a prompt continues, which
bucket its remaining tokens are padded to, the kept turns a request left in its slot, and the
counts their stats report. The engine runs the programs (rl/rollout/engine_programs.py).

* The shared prefix (`rollout.prefix_cache`; rl/rollout/prefix_cache.py): the prefix all
  prompts share (the system turn), its state computed once per weights version.
* Kept turns (`rollout.turn_cache` > 0; rl/rollout/turn_cache.py): a request that ends leaves
  its slot's state for the conversation's next prompt. `keep_turn` notes the slot; the copy
  out of the decode state is taken before the slot's next insert, under the lock that guards
  the last decode state insert / generate returned (`run_insert`, `run_generate`).
"""
import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import numpy as np

from models import qwen3_5
from rl.rollout import prefix_cache as prefix_lib
from rl.rollout import turn_cache as turn_lib


class Continuation(NamedTuple):
  """A prompt's start read from a cached state: what the engine prefills after it."""
  cache: Any           # the cached state (the shared prefix's cache, or a kept slot's)
  tokens: np.ndarray   # [1, bucket] int32: the prompt's tokens after it, padded
  rest: int            # how many of `tokens` are the prompt's
  key_len: int = 0     # for a kept turn, the KV length the new tokens are scored against

  @property
  def length(self) -> np.ndarray:
    return np.asarray([self.rest], np.int32)


def _continuation(cache, prompt: np.ndarray, start: int, bucket: int, key_len: int = 0):
  tokens = np.zeros((1, bucket), np.int32)
  tokens[0, :len(prompt) - start] = prompt[start:]
  return Continuation(cache, tokens, len(prompt) - start, key_len)


class EngineCaches:
  """The shared prefix and the kept turns of one engine, and their counts.

  Args:
    buckets: the engine's prompt buckets, ascending (the last is the longest prompt).
    max_len: tokens per slot.
    prefix_buckets: pad lengths of the part of a prompt after the shared prefix (those not
      under max_len are dropped); () = no shared prefix.
    align: the shared prefix's length is a multiple of it (the Gated DeltaNet chunk).
    prefix_min_len: the shortest shared prefix worth caching.
    turn_cache: finished turns kept; 0 = none.
  """

  def __init__(self, *, buckets: Sequence[int], max_len: int, prefix_buckets: Sequence[int] = (),
               align: int = 1, prefix_min_len: int = 256, turn_cache: int = 0):
    self.buckets = tuple(buckets)
    self.max_len = int(max_len)
    self.prefix_buckets = tuple(sorted({int(b) for b in prefix_buckets if 0 < int(b) < max_len}))
    # Aligned to the Gated DeltaNet chunk, the continuation's chunks are the whole prompt's.
    self._shared = (prefix_lib.SharedPrefix(align, prefix_min_len)
                    if self.prefix_buckets else None)
    self._too_long = 0   # prompts that extend the shared prefix by more than the largest bucket
    self._turns = turn_lib.TurnCache(turn_cache) if turn_cache > 0 else None
    self._turn_too_long = 0   # prompts whose new tokens after a kept turn fit no bucket
    self._turn_mismatched = 0  # kept states whose token count differed from their tokens'
    # The decode state a kept turn is copied from: the last one insert / generate returned,
    # read and replaced under this lock (the next call donates it).
    self._state_lock = threading.Lock()
    self._last_state = None
    self._pending_turns: list[tuple[int, np.ndarray]] = []
    self._row_jit = jax.jit(lambda cache, version, slot: (qwen3_5.cache_row(cache, slot),
                                                          version[slot]))

  @property
  def shares_prefix(self) -> bool:
    return self._shared is not None

  @property
  def keeps_turns(self) -> bool:
    return self._turns is not None

  # -- the shared prefix --------------------------------------------------------------------

  def after_shared(self, prompt: np.ndarray, version: int,
                   compute: Callable[[np.ndarray], Any]) -> Optional[Continuation]:
    """The prompt's start from the shared prefix's cache (computed by `compute(prefix ids)`
    when the version has none), its rest padded to the smallest prefix bucket that holds it;
    None when the prompt does not extend the shared prefix or no bucket holds the rest."""
    n_prefix = self._shared.match(prompt)
    if not n_prefix:
      return None
    rest = len(prompt) - n_prefix
    fits = [b for b in self.prefix_buckets if b >= rest and n_prefix + b <= self.max_len]
    if not fits:
      self._too_long += 1
      return None
    prefix_cache = self._shared.cache_for(version, prompt[:n_prefix], compute)
    return _continuation(prefix_cache, prompt, n_prefix, fits[0])

  def warm_shared(self, prefix: Sequence[int], prefill: Callable[[np.ndarray], Any]) -> list:
    """Primes the shared prefix with `prefix` and runs `prefill(prompt)` (the serving path,
    which computes the prefix's cache on the way) on one prompt extending it per prefix bucket
    that the longest prompt bucket holds. Returns what `prefill` returned; [] when `prefix` is
    too short to be cached. The hits stay those of requests; the computes start at 0."""
    n = self._shared.prime(prefix)
    if not n:
      return []
    hits = self._shared.hits
    out = []
    for b in self.prefix_buckets:
      if n + b > self.buckets[-1]:
        continue
      prompt = np.zeros((n + b,), np.int32)
      prompt[:n] = np.asarray(prefix, np.int32)[:n]
      out.append(prefill(prompt))
    self._shared.hits, self._shared.computes = hits, 0
    return out

  def prefix_stats(self) -> dict:
    """Prompts that extended the shared prefix (hits; of them, too_long: a rest longer than the
    largest prefix bucket, prefilled whole) or not (misses), the prefix's recomputes (one per
    weights version and prefix) and its length. {} without a shared prefix."""
    if self._shared is None:
      return {}
    t = self._shared.tokens
    return dict(hits=self._shared.hits, too_long=self._too_long, misses=self._shared.misses,
                computes=self._shared.computes, prefix_len=0 if t is None else len(t))

  # -- kept turns ---------------------------------------------------------------------------

  def keep_turn(self, slot: int, tokens: Sequence[int]) -> None:
    """Slot `slot`'s request has ended and its state holds `tokens`: keep that state (copied
    before the slot's next insert). A no-op without a turn cache."""
    if self._turns is None:
      return
    with self._state_lock:
      self._pending_turns.append((int(slot), np.asarray(tokens, np.int32)))

  def _take_pending_turns(self) -> None:
    """Copies the slots of requests that ended out of the last decode state (lock held)."""
    pending, self._pending_turns = self._pending_turns, []
    if self._last_state is None:
      return
    state = self._last_state
    for slot, tokens in pending:
      cache, version = self._row_jit(state["cache"], state["version"], np.int32(slot))
      self._turns.keep(tokens, version, cache)

  def run_insert(self, insert: Callable[[], Any]):
    """Runs `insert()` (-> the new decode state) under the state lock, after the kept turns are
    copied out (one may be in the slot it overwrites); its state is the one turns are copied
    from next."""
    with self._state_lock:
      self._take_pending_turns()
      self._last_state = insert()
      return self._last_state

  def run_generate(self, generate: Callable[[], tuple]) -> tuple:
    """Runs `generate()` (-> (new decode state, ...)) under the state lock; its state is the
    one turns are copied from next."""
    with self._state_lock:
      out = generate()
      self._last_state = out[0]
      return out

  def after_turn(self, prompt: np.ndarray, version: int) -> Optional[Continuation]:
    """The prompt's start from a kept turn it extends (taken: a conversation continues once),
    its new tokens padded to the smallest bucket that holds them; None when it extends none
    (or one kept under other weights), when the kept state does not hold exactly the turn's
    tokens, or when no bucket holds the new tokens."""
    with self._state_lock:
      self._take_pending_turns()
    hit = self._turns.take(prompt, version)
    if hit is None:
      return None
    n_kept, turn_cache = hit
    if int(turn_cache["pos"][0]) != n_kept:
      # The slot moved past (or fell short of) its request's tokens: never serve from it.
      self._turn_mismatched += 1
      return None
    rest = len(prompt) - n_kept
    fits = [b for b in (self.prefix_buckets or self.buckets)
            if b >= rest and n_kept + b <= self.max_len]
    if not fits:
      self._turn_too_long += 1
      return None
    # Keys up to a prefill bucket: one compile per (bucket, key bucket) pair, at first use.
    key_len = min([b for b in self.buckets if b >= n_kept + fits[0]] + [self.max_len])
    return _continuation(turn_cache, prompt, n_kept, fits[0], key_len)

  def clear_turns(self) -> None:
    """Drops every kept turn (they were computed under weights no longer served)."""
    if self._turns is not None:
      self._turns.clear()

  def turn_stats(self) -> dict:
    """Turns kept, prompts that continued one (hits) or none (misses), that extended one kept
    under other weights (stale), whose new tokens fit no bucket (too_long), of the hits those
    whose kept state held another number of tokens than its request (mismatched: 0 unless the
    hold of finished slots failed; prefilled as without the cache), entries dropped for room
    (evicted) and held now. {} without a turn cache."""
    if self._turns is None:
      return {}
    return dict(self._turns.stats(), too_long=self._turn_too_long,
                mismatched=self._turn_mismatched)
