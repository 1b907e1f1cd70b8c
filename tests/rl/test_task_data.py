"""Task data: the checkpointed task stream, eval/train selection, the pass-rate filter."""
import json

import pytest

from configs import tiny_cpu
from rl import task_data


def test_task_stream_is_shuffled_epoch_aware_and_resumable():
  tasks = list(range(10))
  a = task_data.TaskStream(tasks, seed=3)
  first = a.take(10)
  assert sorted(first) == tasks and first != tasks  # one epoch = a permutation
  second = a.take(4)
  assert a.position == 14 and a.epoch == pytest.approx(1.4)
  b = task_data.TaskStream(tasks, seed=3, position=10)  # resumed from a checkpointed position
  assert b.take(4) == second


def test_tiny_config_eval_subset_has_at_least_160_held_out_tasks():
  c = tiny_cpu.get_config()
  ev = task_data.select_tasks(c, "eval", c.loop.eval_levels, c.loop.eval_max_tasks)
  tr = task_data.select_tasks(c, "train", c.loop.levels)
  assert len(ev) >= 160
  assert not {t.world_id for t in ev} & {t.world_id for t in tr}


def test_families_filter_keeps_only_the_named_train_families_and_rejects_unknown_ones():
  c = tiny_cpu.get_config()
  every = task_data.select_tasks(c, "train", c.loop.levels)
  picked = task_data.select_tasks(c, "train", c.loop.levels, families=("docx_lookup", "pdf_lookup"))
  assert {t.family for t in picked} == {"docx_lookup", "pdf_lookup"}
  assert [t.id for t in picked] == [t.id for t in every if t.family in ("docx_lookup", "pdf_lookup")]
  with pytest.raises(ValueError, match="docs_lookup"):
    task_data.select_tasks(c, "train", c.loop.levels, families=("docs_lookup",))


def _rates_file(tmp_path, rates: dict) -> str:
  path = str(tmp_path / "rates.json")
  with open(path, "w") as f:
    json.dump({"pass_rate": rates, "samples_per_task": 4}, f)
  return path


def test_train_pool_keeps_only_tasks_whose_measured_pass_rate_is_in_range(tmp_path):
  c = tiny_cpu.get_config()
  every = task_data.select_tasks(c, "train", c.loop.levels)
  rates = {t.id: [0.0, 0.25, 0.5, 1.0][i % 4] for i, t in enumerate(every[:40])}
  with c.unlocked():
    c.loop.train_pass_rates = _rates_file(tmp_path, rates)
  assert [t.id for t in task_data.train_pool(c)] == [t.id for t in every]   # no range: every task
  c.loop.train_pass_range = (0.2, 0.8)
  kept = task_data.train_pool(c)
  # In range and in split order; tasks the file does not rate are dropped with the rest.
  assert [t.id for t in kept] == [t.id for t in every[:40] if 0.2 <= rates[t.id] <= 0.8]
  assert len(kept) == 20


def test_train_pool_filter_names_each_bad_setting(tmp_path):
  c = tiny_cpu.get_config()
  c.loop.train_pass_range = (0.2, 0.8)
  with pytest.raises(ValueError, match="names no file"):
    task_data.train_pool(c)
  c.loop.train_pass_rates = str(tmp_path / "missing.json")
  with pytest.raises(FileNotFoundError, match="mode=pass_rates"):
    task_data.train_pool(c)
  (tmp_path / "bad.json").write_text('{"rates": {}}')
  c.loop.train_pass_rates = str(tmp_path / "bad.json")
  with pytest.raises(ValueError, match="not a pass-rate file"):
    task_data.train_pool(c)
  c.loop.train_pass_rates = _rates_file(tmp_path, {"train-none-000": 0.5})
  with pytest.raises(ValueError, match="no train task has a measured pass rate"):
    task_data.train_pool(c)
  c.loop.train_pass_range = (0.8, 0.2)
  with pytest.raises(ValueError, match="lo <= hi"):
    task_data.train_pool(c)


def test_tasks_from_a_file_without_a_level_pass_every_level_filter(tmp_path):
  world = tmp_path / "world"
  world.mkdir()
  lines = [dict(id=f"t{i}", split="train", prompt="p", domain="d", world_dir="world",
                rubric=[{"type": "judge", "instruction": "ok"}], **extra)
           for i, extra in enumerate([{}, {"level": 2}, {"level": 1}, {"family": "memo"}])]
  path = tmp_path / "tasks.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in lines))
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.envs.tasks_file = str(path)
  assert [t.id for t in task_data.select_tasks(c, "train", (1,))] == ["t0", "t2", "t3"]
  assert [t.id for t in task_data.select_tasks(c, "train", (2,), families=("memo",))] == ["t3"]
