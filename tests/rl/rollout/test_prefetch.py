"""RolloutPrefetcher: step batches drawn ahead in a background thread, never more than
max_staleness weight versions behind the step that trains on them."""
import threading
import time

import pytest

from rl.rollout.prefetch import RolloutPrefetcher


class _Run:
  """A trainer at `version` (= the step it is at) and a draw that records when it ran."""

  def __init__(self, draw_s=0.02):
    self.version = 0
    self.draws = []          # (step, version when the draw started, thread name)
    self.draw_s = draw_s
    self.running = threading.Event()

  def draw(self, step):
    self.running.set()
    self.draws.append((step, self.version, threading.current_thread().name))
    time.sleep(self.draw_s)
    self.running.clear()
    return f"batch {step}"


def _train(run, prefetch, steps, start=0, train_s=0.05):
  got = []
  for step in range(start, steps):
    got.append(prefetch.get(step))
    time.sleep(train_s)
    run.version = step + 1
  prefetch.close()
  return got


def test_without_staleness_each_batch_is_drawn_in_the_callers_thread_from_its_steps_weights():
  run = _Run()
  got = _train(run, RolloutPrefetcher(run.draw, 0, last_step=3), 4)
  assert got == [f"batch {s}" for s in range(4)]
  assert [(s, v) for s, v, _ in run.draws] == [(s, s) for s in range(4)]
  assert {t for _, _, t in run.draws} == {threading.current_thread().name}


@pytest.mark.parametrize("k", [1, 2])
def test_batches_are_drawn_ahead_in_order_at_most_k_versions_behind(k):
  run = _Run()
  got = _train(run, RolloutPrefetcher(run.draw, k, last_step=5), 6)
  assert got == [f"batch {s}" for s in range(6)]
  assert [s for s, _, _ in run.draws] == list(range(6))      # each once, in step order
  staleness = [s - v for s, v, _ in run.draws]
  assert max(staleness) <= k
  assert max(staleness) >= 1                                 # some draws overlapped training
  assert all(t.startswith("rollouts") for _, _, t in run.draws)


def test_a_resumed_run_draws_from_its_start_step_and_nothing_past_the_last():
  run = _Run()
  run.version = 3
  got = _train(run, RolloutPrefetcher(run.draw, 2, last_step=4), 5, start=3)
  assert got == ["batch 3", "batch 4"]
  assert [s for s, _, _ in run.draws] == [3, 4]


def test_drain_leaves_no_draw_running_and_keeps_the_drawn_batches():
  run = _Run(draw_s=0.1)
  prefetch = RolloutPrefetcher(run.draw, 2, last_step=5)
  assert prefetch.get(0) == "batch 0"
  prefetch.drain()
  assert not run.running.is_set()
  assert [s for s, _, _ in run.draws] == [0, 1, 2]
  assert prefetch.get(1) == "batch 1"
  prefetch.close()


def test_bad_settings_and_out_of_order_steps_are_errors():
  with pytest.raises(ValueError, match="max_staleness"):
    RolloutPrefetcher(lambda s: s, -1, last_step=3)
  prefetch = RolloutPrefetcher(lambda s: s, 1, last_step=3)
  assert prefetch.get(0) == 0
  with pytest.raises(ValueError, match="out of order"):
    prefetch.get(3)
  prefetch.close()
