"""`TrainExample`: the batch that crosses from the harness's trajectories to the train step.

B rows (prompts_per_step x samples_per_prompt trajectories, a group's rows sharing a group id) of
T tokens each (T: the row length bucket that holds the step's longest trajectory, one of
train.seq_buckets / train.seq_len). Host numpy arrays; `TrainStep.shard_batch` lays them out over
the mesh's batch axes. Advantages are not here: the train step computes them from `rewards`,
`group_ids` and `valid` (rl/advantages.py), so the same batch serves every advantage estimator.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class TrainExample:
  """One RL step's rows, as the train step reads them.

  Attributes:
    tokens: [B, T] int32, the whole trajectory (system prompt, user turn, assistant turns,
      tool results), right-padded with 0.
    loss_mask: [B, T] int32, 1 on the tokens the policy sampled (assistant turns) of rows that
      may be trained on; 0 on prompt, tool results, padding, and on every token of a row that
      group masking excluded.
    rollout_logprobs: [B, T] float32, the log-probability each sampled token was drawn with by
      the rollout engine (0 elsewhere): the behaviour policy of the importance ratio.
    rewards: [B] float32, the world's grade of each trajectory (0 for a context overflow).
    group_ids: [B] int32, the group (task) of each row; GRPO normalises within a group.
    valid: [B] bool, group masking's verdict (envs/harness/collate.py): False for rows that an
      infrastructure fault or too many timeouts excluded from training.
  """
  tokens: np.ndarray
  loss_mask: np.ndarray
  rollout_logprobs: np.ndarray
  rewards: np.ndarray
  group_ids: np.ndarray
  valid: np.ndarray

  @classmethod
  def from_collated(cls, arrays: dict) -> "TrainExample":
    """From `envs.harness.collate.collate`'s arrays (its `train_mask` is `valid`)."""
    return cls(tokens=arrays["tokens"], loss_mask=arrays["loss_mask"],
               rollout_logprobs=arrays["rollout_logprobs"], rewards=arrays["rewards"],
               group_ids=arrays["group_ids"], valid=arrays["train_mask"])

  def as_arrays(self) -> dict:
    """name -> array: the layout the jitted train step takes."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @property
  def num_rows(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def row_len(self) -> int:
    return int(self.tokens.shape[1])
