"""From episode results to a training batch: group masking, padding, per-batch counts.

Layout of `collate`'s output (B trajectories, T = pad length), all numpy:
  tokens            [B, T] int32   prompt + sampled + observation ids, right-padded with pad_id
  loss_mask         [B, T] int32   1 on sampled ids of trainable trajectories, else 0
  rollout_logprobs  [B, T] float32 logprob of tokens[b, t] under the rollout policy where
                                   loss_mask is 1 (aligned with the token, not shifted), else 0
  lengths           [B]    int32   unpadded length
  prompt_lens       [B]    int32   length of the first prompt
  rewards           [B]    float32 graded reward (0 for context overflow and failures)
  group_ids         [B]    int32   prompt group of each trajectory (GRPO groups)
  train_mask        [B]    bool    False where group masking removed the trajectory
  outcome_ids       [B]    int32   index into envs.harness.errors.OUTCOMES
  turns             [B]    int32   assistant turns
"""
import collections
from typing import Sequence

import numpy as np

from envs.harness import errors
from envs.harness.world import EpisodeResult


def group_train_mask(results: Sequence[EpisodeResult], max_timeouts_per_group: int
                     ) -> np.ndarray:
  """Which trajectories may be trained on (docs/design.md, "Error taxonomy and group masking").

  An infrastructure failure (errors.GROUP_FATAL: engine_error, world_crash, harness_bug,
  malformed_result) masks its whole group;
  more than `max_timeouts_per_group` timeouts (tool_timeout, episode_timeout) mask the group,
  fewer mask only the timed-out trajectories. Model-caused outcomes train.
  """
  by_group: dict[int, list[int]] = collections.defaultdict(list)
  for i, r in enumerate(results):
    by_group[r.group_id].append(i)
  mask = np.ones(len(results), bool)
  for members in by_group.values():
    outcomes = [results[i].outcome for i in members]
    timeouts = sum(o in errors.TIMEOUTS for o in outcomes)
    if any(o in errors.GROUP_FATAL for o in outcomes) or timeouts > max_timeouts_per_group:
      mask[members] = False
      continue
    for i in members:
      if results[i].outcome not in errors.MODEL_OUTCOMES:
        mask[i] = False
  return mask


def collate(results: Sequence[EpisodeResult], max_timeouts_per_group: int,
            pad_to: int | None = None, pad_id: int = 0) -> dict[str, np.ndarray]:
  """Pads the trajectories into arrays; see the module docstring for the layout.

  Args:
    results: one per trajectory.
    max_timeouts_per_group: the group-masking rule's threshold.
    pad_to: row length; None = the longest trajectory. A longer trajectory is an error
      (the harness's context limit must not exceed the training row length).
    pad_id: id written after the end of each row.
  """
  train = group_train_mask(results, max_timeouts_per_group)
  longest = max((len(r.tokens) for r in results), default=0)
  t = pad_to if pad_to is not None else max(longest, 1)
  if longest > t:
    raise ValueError(f"a trajectory has {longest} tokens, more than the row length {t}; "
                     "lower the harness context limit or raise the row length")
  b = len(results)
  out = {
      "tokens": np.full((b, t), pad_id, np.int32),
      "loss_mask": np.zeros((b, t), np.int32),
      "rollout_logprobs": np.zeros((b, t), np.float32),
      "lengths": np.zeros(b, np.int32),
      "prompt_lens": np.zeros(b, np.int32),
      "rewards": np.zeros(b, np.float32),
      "group_ids": np.zeros(b, np.int32),
      "train_mask": train,
      "outcome_ids": np.zeros(b, np.int32),
      "turns": np.zeros(b, np.int32),
  }
  for i, r in enumerate(results):
    n = len(r.tokens)
    out["tokens"][i, :n] = r.tokens
    if train[i]:
      out["loss_mask"][i, :n] = r.loss_mask
    out["rollout_logprobs"][i, :n] = r.rollout_logprobs
    out["lengths"][i] = n
    out["prompt_lens"][i] = r.prompt_len
    out["rewards"][i] = 0.0 if r.outcome == errors.CONTEXT_OVERFLOW else r.reward
    out["group_ids"][i] = r.group_id
    out["outcome_ids"][i] = errors.OUTCOMES.index(r.outcome)
    out["turns"][i] = r.turns
  return out


def batch_metrics(results: Sequence[EpisodeResult], max_timeouts_per_group: int | None = None
                  ) -> dict[str, float]:
  """Per-batch counts of every outcome and event class (all present, zeros included)."""
  n = len(results)
  m: dict[str, float] = {"episodes": n}
  outcomes = collections.Counter(r.outcome for r in results)
  for o in errors.OUTCOMES:
    m[f"outcome/{o}"] = outcomes.get(o, 0)
  events = collections.Counter()
  for r in results:
    events.update(r.events)
  for k in errors.EVENTS:
    m[f"event/{k}"] = events.get(k, 0)
  # The taxonomy's per-class counts: every occurrence for classes that are also events
  # (a malformed call counts whether or not it ended its episode), else the outcomes.
  for c in errors.ERROR_CLASSES:
    m[f"errors/{c}"] = events.get(c, 0) if c in errors.EVENTS else outcomes.get(c, 0)
  # Judge criteria the judge could not decide (graded not met; the episode keeps its outcome).
  m[f"errors/{errors.JUDGE_ERROR}"] = events.get(errors.JUDGE_ERROR, 0)
  if n:
    m["pass_rate"] = sum(r.passed for r in results) / n
    m["mean_reward"] = sum(r.reward for r in results) / n
    m["mean_turns"] = sum(r.turns for r in results) / n
    m["mean_tokens"] = sum(len(r.tokens) for r in results) / n
    # Where an episode's wall time goes (model, tool, world_start, start_queue, grade, close,
    # harness), mean seconds per episode: on a small machine the worlds can cost as much as
    # the model.
    kinds = sorted({k for r in results for k in r.timing})
    for k in kinds:
      m[f"episode_s/{k}"] = sum(r.timing.get(k, 0.0) for r in results) / n
  if max_timeouts_per_group is not None and n:
    m["trained_fraction"] = float(group_train_mask(results, max_timeouts_per_group).mean())
  return m
