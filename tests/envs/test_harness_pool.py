"""How the agent pool hands episodes to workers: warm worlds first, then worlds nobody holds."""
import os

from configs import base
from envs.harness.pool import _take, world_start_slots
from envs.harness.world import Episode


def _eps(worlds):
  return [(i, Episode(task_id=f"t{i}", prompt="p", world=None, meta={"world_id": w}))
          for i, w in enumerate(worlds)]


def test_worker_takes_an_episode_of_its_warm_world_first():
  pending = _eps(["w0", "w1", "w1"])
  idx, _ = _take(pending, "w1", frozenset({"w0"}))
  assert idx == 1 and [i for i, _ in pending] == [0, 2]


def test_worker_without_a_warm_episode_avoids_worlds_other_workers_hold():
  pending = _eps(["w0", "w0", "w1", "w1"])
  idx, _ = _take(pending, None, frozenset({"w0"}))
  assert idx == 2                            # w0's samples wait for the worker that holds w0
  idx, _ = _take(pending, "w9", frozenset({"w0", "w1"}))
  assert idx == 0                            # every world held: first in line


def test_groups_of_one_world_cost_one_world_start_each():
  """4 workers, 4 groups of 4 samples (one world a group), finishing in turn: a worker runs
  its group's samples on its warm world, so 4 world starts instead of 16."""
  pending = _eps([f"w{g}" for g in range(4) for _ in range(4)])
  worlds = [None] * 4
  busy = [None] * 4
  starts = 0
  for w in range(4):                          # every worker takes a first episode
    held = frozenset(x for k, x in enumerate(busy) if x is not None)
    _, ep = _take(pending, worlds[w], held)
    starts += ep.meta["world_id"] != worlds[w]
    worlds[w] = busy[w] = ep.meta["world_id"]
  while pending:
    for w in range(4):                        # they finish one after another
      if not pending:
        break
      busy[w] = None
      held = frozenset(x for k, x in enumerate(busy) if x is not None)
      _, ep = _take(pending, worlds[w], held)
      starts += ep.meta["world_id"] != worlds[w]
      worlds[w] = busy[w] = ep.meta["world_id"]
  assert starts == 4


def test_world_start_slots_default_scales_with_usable_cores_and_explicit_values_stand():
  assert world_start_slots(-1) == 2 * len(os.sched_getaffinity(0))
  assert world_start_slots(3) == 3
  assert world_start_slots(0) == 0   # no limit


def test_base_config_world_start_gate_is_four_on_a_two_core_host():
  assert base.get_config().harness.max_world_starts == -1
  if len(os.sched_getaffinity(0)) == 2:
    assert world_start_slots(base.get_config().harness.max_world_starts) == 4
