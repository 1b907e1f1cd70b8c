"""rl/distributed.py on one process: shares cover a list once, in order; config differences are
named key by key; a single process needs no coordinator. (Two processes: tests/scripts.)"""
import pytest

from configs import tiny_cpu
from rl import distributed


@pytest.mark.parametrize("n,count", [(10, 3), (4, 2), (3, 4), (480, 2), (0, 2)])
def test_shares_are_contiguous_blocks_covering_every_item_once_in_order(n, count):
  blocks = [list(range(n))[distributed.share(n, i, count)] for i in range(count)]
  assert [x for b in blocks for x in b] == list(range(n))
  assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_config_differences_name_every_differing_or_missing_key():
  a, b = tiny_cpu.get_config(), tiny_cpu.get_config()
  b.seed, b.train.steps = 7, 3
  assert distributed.differences(distributed._flat(a), distributed._flat(b)) == [
      "seed", "train.steps"]
  assert distributed.differences({"x": "1"}, {}) == ["x"]


def test_one_process_runs_without_a_coordinator_and_exchanges_with_itself(monkeypatch):
  for k in distributed.COORDINATOR_VARS:
    monkeypatch.delenv(k, raising=False)
  assert not distributed.requested()
  c = tiny_cpu.get_config()
  distributed.initialize(c)
  distributed.check_same_run(c)
  assert distributed.exchange("t", {"a": 1}) == [{"a": 1}]
  assert distributed.gather("u", [1, 2]) == [1, 2] and distributed.is_writer()
