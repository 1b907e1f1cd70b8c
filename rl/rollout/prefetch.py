"""Rollouts drawn ahead of the train step, with bounded staleness (loop.max_staleness).

    prefetch = RolloutPrefetcher(draw, max_staleness=1, last_step=steps - 1)
    for step in range(start, steps):
      batch = prefetch.get(step)      # drawn for `step`, from weights at most 1 version old
      ... train step, weight sync ...
    prefetch.close()

`draw(step)` rolls out one step's batch with whatever weights the servers hold when it runs.
With max_staleness k = 0 it runs in the caller's thread when the step asks for it: the
synchronous loop, every rollout from the weights the step trains. With k >= 1 one background
thread draws the batches of steps step+1..step+k while the trainer works on step `step`, so
rollouts and the train step overlap. The draw of step s is submitted while the trainer is at
step s - k, i.e. once weights version s - k is served (the loop syncs version s after step
s - 1), and draws run in step order, so it starts from version s - k or newer: a batch is at most
k versions behind the weights it trains. A generation running across a weight sync samples
its later tokens from the new weights; every token's logprob is the one it was sampled with,
and the policy loss's importance terms (rl/policy_losses.py: old vs rollout logprobs) weigh
each token against the policy that actually sampled it.
"""
import collections
import concurrent.futures
from typing import Any, Callable


class RolloutPrefetcher:
  """Draws step batches up to `max_staleness` steps ahead in one background thread.

  Args:
    draw: step -> that step's batch (any object); called once per step, in step order.
    max_staleness: how many steps ahead draws may run (0 = synchronous, in the caller).
    last_step: the last step a batch is drawn for.
  """

  def __init__(self, draw: Callable[[int], Any], max_staleness: int, last_step: int):
    if max_staleness < 0:
      raise ValueError(f"loop.max_staleness must be >= 0, got {max_staleness}")
    self._draw = draw
    self.max_staleness = int(max_staleness)
    self.last_step = int(last_step)
    self._pending: collections.OrderedDict = collections.OrderedDict()   # step -> Future
    self._next = None   # the next step to submit
    self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")
                  if self.max_staleness else None)

  def get(self, step: int):
    """The batch drawn for `step`; first submits the draws of the steps up to step + k."""
    if self._pool is None:
      return self._draw(step)
    if self._next is None:
      self._next = step
    if step not in self._pending and step != self._next:
      raise ValueError(f"batch of step {step} asked for out of order (next is {self._next})")
    while self._next <= min(step + self.max_staleness, self.last_step):
      self._pending[self._next] = self._pool.submit(self._draw, self._next)
      self._next += 1
    return self._pending.pop(step).result()

  def drain(self) -> None:
    """Waits until no draw is running (their batches stay for later steps): the agent pool is
    then free for another use, e.g. a held-out eval."""
    for f in list(self._pending.values()):
      f.exception()

  def close(self) -> None:
    """Cancels draws not yet started and waits for a running one."""
    if self._pool is not None:
      for f in self._pending.values():
        f.cancel()
      self._pool.shutdown(wait=True)
      self._pending.clear()
