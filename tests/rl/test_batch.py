"""Episode results -> TrainExample: row buckets, batch-shape checks, group filters, dynamic sampling."""
import dataclasses

import numpy as np
import pytest

from configs import tiny_cpu
from configs import tiny_gpu
from envs.harness.world import EpisodeResult
from models import sharding
from rl import batch
from rl.train_example import TrainExample
from rl.train_step import TrainStep


def test_tiny_gpu_config_is_the_tiny_model_with_a_larger_batch_that_splits():
  g, c = tiny_gpu.get_config(), tiny_cpu.get_config()
  batch.check_batch_shape(g)
  assert g.model.to_dict() == c.model.to_dict() and g.train.init_from == c.train.init_from
  assert g.train.prompts_per_step * g.train.samples_per_prompt == 16 * (
      c.train.prompts_per_step * c.train.samples_per_prompt)
  with pytest.raises(ValueError, match="takes no argument"):
    tiny_gpu.get_config("base")


def test_batch_that_does_not_split_into_micro_batches_is_a_clear_error():
  c = tiny_cpu.get_config()
  batch.check_batch_shape(c)                       # the default splits
  c.train.prompts_per_step, c.train.samples_per_prompt = 1, 2
  with pytest.raises(ValueError, match="train.micro_batches"):
    batch.check_batch_shape(c)


def test_a_training_row_shorter_than_the_context_is_a_clear_error():
  c = tiny_cpu.get_config()
  c.train.seq_len = c.train.max_context - 1
  with pytest.raises(ValueError, match="train.seq_len=2559 < train.max_context=2560"):
    batch.check_batch_shape(c)


def _episode(group, sample, reward, outcome="ok"):
  return EpisodeResult(task_id=f"t{group}", group_id=group, sample_index=sample, outcome=outcome,
                       tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1],
                       rollout_logprobs=[0.0, 0.0, -1.0, -1.0], prompt_len=2, reward=reward,
                       passed=reward == 1.0)


def test_dynamic_sampling_keeps_groups_with_signal_first_and_renumbers_them():
  c = tiny_cpu.get_config()
  rewards = {10: (1, 1), 11: (0, 1), 12: (0, 0), 13: (1, 0), 14: (0, 1)}   # 11, 13, 14 split
  results = [_episode(g, k, float(r)) for g, rs in rewards.items() for k, r in enumerate(rs)]
  assert batch.informative_groups(results, c) == [11, 13, 14]
  live = batch.informative_groups(results, c)
  picked = batch.pick_groups(results, live, 2)
  assert [r.task_id for r in picked] == ["t11", "t11", "t13", "t13"]
  assert [r.group_id for r in picked] == [0, 0, 1, 1]
  # Too few with signal: filled with the first groups without, so the batch keeps its shape.
  picked = batch.pick_groups(results, live, 4)
  assert [r.task_id for r in picked][::2] == ["t11", "t13", "t14", "t10"]
  example, m = batch.build_batch(picked, c)
  assert m["train/live_rows"] == 6.0
  # The typed batch: group masking's verdict is `valid`; one row per episode.
  assert isinstance(example, TrainExample) and example.num_rows == len(picked)
  assert example.valid.dtype == bool and example.valid.all()
  with pytest.raises(ValueError, match="5 groups drawn, 6 needed"):
    batch.pick_groups(results, live, 6)


def test_a_steps_rows_pad_to_the_shortest_bucket_that_holds_its_longest_trajectory():
  c = tiny_cpu.get_config()
  c.train.seq_buckets = (8, 1024)
  short = [_episode(0, 0, 1.0), _episode(0, 1, 0.0)]
  assert batch.build_batch(short, c)[0].tokens.shape == (2, 8)
  longer = short + [dataclasses.replace(_episode(1, 0, 1.0), tokens=list(range(9)),
                                        loss_mask=[0] * 2 + [1] * 7,
                                        rollout_logprobs=[0.0] * 9)]
  assert batch.build_batch(longer, c)[0].tokens.shape == (3, 1024)
  assert batch.row_length(c, 2000) == c.train.seq_len == 2560   # past every bucket
  batch.check_batch_shape(c)
  c.train.seq_buckets = (8, 4096)
  with pytest.raises(ValueError, match=r"train.seq_buckets \(8, 4096\): \[4096\] not in"):
    batch.check_batch_shape(c)


def test_a_group_masked_for_timeouts_carries_no_signal_for_dynamic_sampling():
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.harness.max_timeouts_per_group = 0
  results = [_episode(0, 0, 1.0), _episode(0, 1, 0.0, outcome="tool_timeout"),
             _episode(1, 0, 1.0), _episode(1, 1, 0.0)]
  assert batch.informative_groups(results, c) == [1]


def test_the_train_step_lays_out_a_train_example_as_its_arrays():
  c = tiny_cpu.get_config()
  c.train.seq_buckets = (8,)
  results = [_episode(g, k, float(k)) for g in range(4) for k in range(2)]
  example, _ = batch.build_batch(results, c)
  assert set(example.as_arrays()) == {"tokens", "loss_mask", "rollout_logprobs", "rewards",
                                      "group_ids", "valid"}
  assert example.tokens.shape == example.loss_mask.shape == (8, 8) and example.row_len == 8
  step = TrainStep(c, sharding.make_mesh(c.mesh))
  typed, plain = step.shard_batch(example), step.shard_batch(example.as_arrays())
  assert set(typed) == set(plain)
  for k in typed:
    assert typed[k].sharding == plain[k].sharding
    np.testing.assert_array_equal(np.asarray(typed[k]), np.asarray(plain[k]))
