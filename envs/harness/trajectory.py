"""An append-only token trajectory: the single record of what the model saw and sampled.

Token-in/token-out: the sampled ids and their logprobs go in exactly as the policy returned
them, and everything else (prompt, tool results, repair messages, nudges) goes in as ids
built from template pieces. Nothing is ever decoded and re-encoded, rewritten or removed, so
the trainer scores exactly the tokens the engine sampled.
"""
from typing import Sequence

import numpy as np


class Trajectory:
  """Tokens, loss mask (1 only on sampled ids) and rollout logprobs, growing in step."""

  __slots__ = ("_tokens", "_mask", "_logprobs", "prompt_len")

  def __init__(self, prompt_ids: Sequence[int]):
    self._tokens: list[int] = list(prompt_ids)
    self._mask: list[int] = [0] * len(self._tokens)
    self._logprobs: list[float] = [0.0] * len(self._tokens)
    self.prompt_len = len(self._tokens)

  def __len__(self) -> int:
    return len(self._tokens)

  def append_sampled(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
    """The policy's own output: trained on (mask 1), with the logprobs it was sampled with."""
    if len(ids) != len(logprobs):
      raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} logprobs")
    # Engines may hand back numpy scalars: store plain ints and floats (exact values).
    self._tokens.extend(map(int, ids))
    self._mask.extend([1] * len(ids))
    self._logprobs.extend(map(float, logprobs))

  def append_context(self, ids: Sequence[int]) -> None:
    """Ids the harness adds (tool results, repair messages, turn delimiters): mask 0."""
    # Harness-built ids come from the tokenizer as Python ints: no per-id conversion.
    self._tokens.extend(ids)
    self._mask.extend([0] * len(ids))
    self._logprobs.extend([0.0] * len(ids))

  @property
  def tokens(self) -> tuple[int, ...]:
    return tuple(self._tokens)

  @property
  def loss_mask(self) -> tuple[int, ...]:
    return tuple(self._mask)

  @property
  def logprobs(self) -> tuple[float, ...]:
    return tuple(self._logprobs)

  def ids(self) -> list[int]:
    """A copy of the token ids (the next prompt for the policy)."""
    return list(self._tokens)

  @property
  def num_sampled(self) -> int:
    return sum(self._mask)

  def to_arrays(self) -> dict[str, np.ndarray]:
    return {"tokens": np.asarray(self._tokens, np.int32),
            "loss_mask": np.asarray(self._mask, np.int32),
            "rollout_logprobs": np.asarray(self._logprobs, np.float32)}
