"""Episode results -> the train step's batch (`TrainExample`), and the group filters around it.

    example, m = build_batch(results, config)   # padded to a row-length bucket, metrics of the draw

Group masking (an infrastructure fault masks a group; envs/harness/collate.py) decides which rows
may be trained on; the zero-variance filter (rl.filter_zero_variance) which groups carry signal.
`informative_groups` and `pick_groups` apply the same rules to choose dynamic sampling's groups.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from configs import validate
from envs.harness.collate import batch_metrics
from envs.harness.collate import collate
from rl import reductions
from rl.train_example import TrainExample
from rl.train_step import row_lengths


def check_batch_shape(config) -> None:
  """The rollout batch must split into mini- and micro-batches and a training row must hold
  the longest trajectory the harness lets grow; said before any rollout."""
  if int(config.train.seq_len) < int(config.train.max_context):
    raise ValueError(
        f"train.seq_len={config.train.seq_len} < train.max_context={config.train.max_context}: "
        f"episodes may grow to train.max_context tokens but a training row holds "
        f"train.seq_len; raise train.seq_len (context parallelism, "
        f"models.sharding.context_parallel_rules, splits long rows over devices)")
  bad = [b for b in config.train.seq_buckets if not 0 < int(b) <= int(config.train.seq_len)]
  if bad:
    raise ValueError(f"train.seq_buckets {tuple(config.train.seq_buckets)}: {bad} not in "
                     f"(0, train.seq_len={config.train.seq_len}]")
  validate.check_batch_split(config)


def row_length(config, longest: int) -> int:
  """The row length a step's batch pads to: the shortest of train.seq_buckets and
  train.seq_len that holds its longest trajectory."""
  lengths = row_lengths(config.train)
  return next((n for n in lengths if n >= longest), lengths[-1])


def build_batch(results, config, batch_ways: int = 1) -> tuple[TrainExample, dict]:
  """Episode results -> the train step's batch and the draw's metrics.

  Rows are padded to `row_length` (one compile per bucket); group masking decides `valid`. With
  one mini-batch, rows of groups without signal are moved into the last micro-batches, which
  the train step then skips (`reductions.pack_live_rows`; the loss does not depend on row order).
  """
  longest = max((len(r.tokens) for r in results), default=0)
  row_len = row_length(config, longest)
  example = TrainExample.from_collated(
      collate(results, config.harness.max_timeouts_per_group, pad_to=row_len))
  m = batch_metrics(results, config.harness.max_timeouts_per_group)
  live = reductions.live_rows(example.rewards, example.group_ids, example.valid, example.loss_mask,
                        config.rl.filter_zero_variance)
  m["train/live_rows"] = float(live.sum())
  m["train/row_len"], m["rollout/longest_tokens"] = float(row_len), float(longest)
  if int(config.train.mini_batches) == 1:
    # Rows of groups with no signal gathered into the last micro-batches, which the train step
    # then skips: with most groups all-pass or all-fail, most of the step's compute.
    # In the step's micro-batches: train.micro_batches, or fewer where the `batch_ways` devices
    # splitting the rows would hold unequal shares (TrainStep.micro_batches).
    n = reductions.micro_batch_count(len(live), int(config.train.micro_batches), batch_ways)
    example = TrainExample(**reductions.pack_live_rows(example.as_arrays(), live, n))
  return example, m


def informative_groups(results, config) -> list[int]:
  """Group ids (in first-seen order) whose rows the train step learns from: the group masking
  and the zero-variance filter of `build_batch`, applied to these results alone."""
  d = collate(results, config.harness.max_timeouts_per_group)
  live = reductions.live_rows(d["rewards"], d["group_ids"], d["train_mask"], d["loss_mask"],
                        config.rl.filter_zero_variance)
  with_signal = {int(g) for g, l in zip(d["group_ids"], live) if l}
  return [g for g in dict.fromkeys(r.group_id for r in results) if g in with_signal]


def pick_groups(results, live: Sequence[int], n_groups: int) -> list:
  """Dynamic sampling's batch: the first `n_groups` groups with signal (`live`, in draw order:
  `informative_groups`), filled up with groups without signal when fewer have it (the step's
  batch keeps one shape), renumbered 0..n_groups-1."""
  order, with_signal = list(dict.fromkeys(r.group_id for r in results)), set(live)
  keep = (list(live) + [g for g in order if g not in with_signal])[:n_groups]
  if len(keep) < n_groups:
    raise ValueError(f"{len(order)} groups drawn, {n_groups} needed")
  new_id = {g: i for i, g in enumerate(keep)}
  by_group = {g: [r for r in results if r.group_id == g] for g in keep}
  return [dataclasses.replace(r, group_id=new_id[g]) for g in keep for r in by_group[g]]
