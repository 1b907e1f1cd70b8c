"""The tokenizer JetStream asks the engine for (`QwenEngine.build_tokenizer`).

JetStream's text requests (its own client, benchmark_serving) are encoded and decoded through
it; the token path the project's callers use never touches it. An engine built without a
tokenizer config hands out `NullTokenizer`, which reports the stop ids and refuses text.
"""
from typing import Sequence

import numpy as np
from jetstream.engine import tokenizer_api

from envs.chat import tokenizer as chat_tokenizer


class TokenTokenizer(tokenizer_api.Tokenizer):
  """JetStream's tokenizer interface over the chat tokenizer (envs/chat).

  Only text requests (JetStream's own client, benchmark_serving) use it; the token path never
  encodes or decodes.
  """

  def __init__(self, tok, stop_ids: Sequence[int]):
    self._tok = tok
    self._stop = set(int(i) for i in stop_ids)

  def encode(self, s: str, **kwargs):
    ids = np.asarray(self._tok.encode(s), np.int32)
    return ids, len(ids)

  def decode(self, token_ids, **kwargs) -> str:
    return self._tok.decode(list(token_ids))

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def eos_id(self) -> int:
    return min(self._stop) if self._stop else 0

  @property
  def bos_id(self) -> int:
    return -1  # Qwen3.5 has no BOS

  @property
  def stop_tokens(self) -> set[int]:
    return set(self._stop)


class NullTokenizer(TokenTokenizer):
  """For engines built without a tokenizer: token requests only."""

  def __init__(self, stop_ids):
    super().__init__(None, stop_ids)

  def encode(self, s, **kwargs):
    raise ValueError("this engine serves token requests only (no tokenizer configured)")

  def decode(self, token_ids, **kwargs) -> str:
    return ""


def for_engine(tokenizer_cfg, stop_ids: Sequence[int]) -> TokenTokenizer:
  """The tokenizer of an engine with the `tokenizer` config section `tokenizer_cfg` (None: a
  `NullTokenizer`) and default stop ids `stop_ids`."""
  if tokenizer_cfg is None:
    return NullTokenizer(stop_ids)
  return TokenTokenizer(chat_tokenizer.from_config(tokenizer_cfg), stop_ids)
