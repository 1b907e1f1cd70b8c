"""Tokenizers for the chat format: a real Qwen3.5 `tokenizer.json`, or the tiny shipped one.

Both are `tokenizers` byte-level BPE files with the Qwen3.5 control tokens. The control ids
are checked at load time against the table the config names, because a tokenizer whose
`<|im_end|>` moved would make every stop id, loss mask and parsed tool call silently wrong.
"""
import dataclasses
import os
from typing import Mapping, Sequence

import tokenizers

# Control tokens of the chat format and their ids in the real Qwen3.5 vocabulary (248320).
QWEN3_5_SPECIAL_IDS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<tool_call>": 248058,
    "</tool_call>": 248059,
    "<tool_response>": 248066,
    "</tool_response>": 248067,
    "<think>": 248068,
    "</think>": 248069,
}
# The same tokens in the shipped tiny vocabulary (1024), where they take the first ids.
TINY_SPECIAL_IDS = {tok: i for i, tok in enumerate(QWEN3_5_SPECIAL_IDS)}

_EXPECTED = {"qwen3_5": QWEN3_5_SPECIAL_IDS, "tiny": TINY_SPECIAL_IDS}


def ordinary_id_range(special_ids: str, vocab_size: int) -> tuple[int, int]:
  """[low, high) ids holding no control token: after the tiny table, before the Qwen3.5 one."""
  if special_ids not in _EXPECTED:
    raise ValueError(f"unknown special_ids table {special_ids!r}; one of {sorted(_EXPECTED)}")
  table = _EXPECTED[special_ids]
  if special_ids == "tiny":
    return len(table), int(vocab_size)
  return 0, min(int(vocab_size), min(table.values()))

TINY_TOKENIZER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "tiny_tokenizer.json")


class TokenizerError(ValueError):
  """The tokenizer file is missing, unreadable, or its control ids are not the expected ones."""


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  """Ids of the chat control tokens."""
  endoftext: int
  im_start: int
  im_end: int
  tool_call: int
  tool_call_end: int
  tool_response: int
  tool_response_end: int
  think: int
  think_end: int

  @classmethod
  def from_table(cls, table: Mapping[str, int]) -> "SpecialIds":
    return cls(
        endoftext=table["<|endoftext|>"], im_start=table["<|im_start|>"],
        im_end=table["<|im_end|>"], tool_call=table["<tool_call>"],
        tool_call_end=table["</tool_call>"], tool_response=table["<tool_response>"],
        tool_response_end=table["</tool_response>"], think=table["<think>"],
        think_end=table["</think>"])

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Generation stops at the end of a turn or of the text."""
    return (self.im_end, self.endoftext)


class Tokenizer:
  """A byte-level BPE tokenizer with the chat control tokens.

  `encode` never adds BOS/EOS. Text that comes from the outside world (tool output, task
  prompts) goes through `encode(..., allow_control=False)`, so a document that happens to
  contain the string "<|im_end|>" cannot forge a control token.
  """

  def __init__(self, hf: tokenizers.Tokenizer, special: SpecialIds, path: str = ""):
    self._hf = hf
    self.special = special
    self.path = path
    self._control = {tok.content: i for i, tok in hf.get_added_tokens_decoder().items()}
    for name in QWEN3_5_SPECIAL_IDS:
      self._control.setdefault(name, hf.token_to_id(name))

  @property
  def vocab_size(self) -> int:
    return self._hf.get_vocab_size(with_added_tokens=True)

  @property
  def control_strings(self) -> tuple[str, ...]:
    return tuple(self._control)

  def token_to_id(self, token: str) -> int | None:
    return self._hf.token_to_id(token)

  def id_to_token(self, i: int) -> str | None:
    return self._hf.id_to_token(i)

  def encode(self, text: str, allow_control: bool = True) -> list[int]:
    """Token ids of `text`, no BOS/EOS added.

    Args:
      text: the text.
      allow_control: when False, control-token strings inside `text` are encoded as plain
        bytes instead of becoming control ids.
    """
    if not text:
      return []
    if allow_control or not any(c in text for c in self._control):
      return self._hf.encode(text, add_special_tokens=False).ids
    return self._encode_literal(text)

  def _encode_literal(self, text: str) -> list[int]:
    # Cut the text at every control string; the cuts are encoded through the model alone,
    # which knows no added tokens, so they come out as ordinary byte-level pieces.
    ids: list[int] = []
    rest = text
    while rest:
      hits = [(rest.find(c), c) for c in self._control if c in rest]
      if not hits:
        ids.extend(self._hf.encode(rest, add_special_tokens=False).ids)
        break
      pos, hit = min(hits, key=lambda h: (h[0], -len(h[1])))
      if pos:
        ids.extend(self._hf.encode(rest[:pos], add_special_tokens=False).ids)
      ids.extend(self._model_only(hit))
      rest = rest[pos + len(hit):]
    return ids

  def _model_only(self, text: str) -> list[int]:
    if self._hf.normalizer is not None:
      text = self._hf.normalizer.normalize_str(text)
    pieces = self._hf.pre_tokenizer.pre_tokenize_str(text) if self._hf.pre_tokenizer else [
        (text, None)]
    return [t.id for piece, _ in pieces for t in self._hf.model.tokenize(piece)]

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`, control tokens included (for parsing and logs, never for training)."""
    return self._hf.decode(list(ids), skip_special_tokens=False)


def check_special_ids(hf: tokenizers.Tokenizer, expected: Mapping[str, int], where: str) -> None:
  """Raises TokenizerError naming every control token whose id differs from `expected`."""
  wrong = []
  for content, want in expected.items():
    got = hf.token_to_id(content)
    if got != want:
      wrong.append(f"{content}: expected id {want}, found {got}")
  if wrong:
    raise TokenizerError(f"{where}: control token ids do not match the chat format: "
                         + "; ".join(wrong))


def resolve_path(path: str) -> str:
  """`path` is a tokenizer.json file or a directory holding one (a Hugging Face checkout)."""
  if os.path.isdir(path):
    path = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(path):
    raise TokenizerError(f"no tokenizer.json at {path}")
  return path


def load_tokenizer(path: str = "", special_ids: str = "tiny") -> Tokenizer:
  """Loads a tokenizer and checks its control ids.

  Args:
    path: a tokenizer.json or a directory with one; "" = the shipped tiny tokenizer.
    special_ids: which id table to check against: "qwen3_5" (the real vocabulary) or "tiny".
  """
  path = resolve_path(path or TINY_TOKENIZER_PATH)
  if special_ids not in _EXPECTED:
    raise TokenizerError(f"unknown special_ids table {special_ids!r}; one of {sorted(_EXPECTED)}")
  try:
    hf = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # the Rust side raises plain Exception on a bad file
    raise TokenizerError(f"cannot read tokenizer {path}: {e}") from e
  expected = _EXPECTED[special_ids]
  check_special_ids(hf, expected, path)
  return Tokenizer(hf, SpecialIds.from_table(expected), path)


def from_config(tok_cfg) -> Tokenizer:
  """Loads the tokenizer named by the `tokenizer` config section."""
  return load_tokenizer(tok_cfg.path, tok_cfg.special_ids)
