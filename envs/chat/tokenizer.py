"""Tokenizers for the chat format: a real Qwen3.5 `tokenizer.json`, or the tiny shipped one.

Both are `tokenizers` byte-level BPE files with the Qwen3.5 control tokens. The control ids
are checked at load time against the table the config names, because a tokenizer whose
`<|im_end|>` moved would make every stop id, loss mask and parsed tool call silently wrong.
With `special_ids="auto"` the ids are read from the checkpoint itself instead: each control
token must be a special added token of its `tokenizer.json`, and a `tokenizer_config.json`
beside it must agree (its `added_tokens_decoder`, and an end-of-sequence token that is one of
the format's stop tokens).
"""
import dataclasses
import json
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
# "auto": the ids are read from the checkpoint's own files (`special_ids_from_files`).
AUTO = "auto"


def ordinary_id_range(special_ids: str, vocab_size: int) -> tuple[int, int]:
  """[low, high) ids holding no control token: after the tiny table, before the Qwen3.5 one."""
  if special_ids == "auto":
    raise ValueError("the ordinary id range (the SFT copy drill's tokens) needs a named "
                     f"tokenizer.special_ids table, one of {sorted(_EXPECTED)}, not 'auto'")
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

  def __init__(self, hf: tokenizers.Tokenizer, special: SpecialIds, path: str = "",
               config: Mapping | None = None):
    self._hf = hf
    self.special = special
    self.path = path
    # The checkpoint's tokenizer_config.json beside `path` ({} when there is none).
    self.config = dict(config or {})
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

  def to_json(self) -> str:
    """The tokenizer.json this tokenizer was read from (its bytes when it came from a file)."""
    if self.path and os.path.isfile(self.path):
      with open(self.path, encoding="utf-8", newline="") as f:
        return f.read()
    return self._hf.to_str()

  def added_tokens(self) -> dict[int, tokenizers.AddedToken]:
    """id -> added token (the control tokens and any other added ones), by id."""
    return dict(sorted(self._hf.get_added_tokens_decoder().items()))


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


def _token_content(value) -> str | None:
  """A tokenizer_config.json token entry: a string, or a dict with `content`."""
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) else None


def special_ids_from_files(hf: tokenizers.Tokenizer, config: Mapping | None,
                           where: str) -> dict[str, int]:
  """The control-token table of a checkpoint, read from its own files.

  Args:
    hf: the checkpoint's tokenizer.json.
    config: its tokenizer_config.json, or None when it has none.
    where: the path, for messages.

  Raises:
    TokenizerError: naming every control token that is missing, not a special added token, or
      placed at another id by tokenizer_config.json; or an eos_token outside the stop tokens.
  """
  added = hf.get_added_tokens_decoder()
  table, wrong = {}, []
  for content in QWEN3_5_SPECIAL_IDS:
    i = hf.token_to_id(content)
    if i is None:
      wrong.append(f"{content}: not in the vocabulary")
    elif i not in added or not added[i].special:
      wrong.append(f"{content}: id {i} is not a special added token")
    else:
      table[content] = i
  config = config or {}
  for key, entry in (config.get("added_tokens_decoder") or {}).items():
    content = _token_content(entry)
    if content in table and int(key) != table[content]:
      wrong.append(f"{content}: tokenizer_config.json says id {key}, tokenizer.json "
                   f"{table[content]}")
  eos = _token_content(config.get("eos_token"))
  if eos is not None and eos not in ("<|im_end|>", "<|endoftext|>"):
    wrong.append(f"eos_token {eos!r} is not a stop token of the chat format "
                 f"(<|im_end|> or <|endoftext|>)")
  if wrong:
    raise TokenizerError(f"{where}: control tokens do not fit the chat format: "
                         + "; ".join(wrong))
  return table


def read_tokenizer_config(tokenizer_json: str) -> dict | None:
  """The tokenizer_config.json beside a tokenizer.json, or None when there is none."""
  path = os.path.join(os.path.dirname(os.path.abspath(tokenizer_json)), "tokenizer_config.json")
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError) as e:
    raise TokenizerError(f"cannot read {path}: {e}") from e
  if not isinstance(config, dict):
    raise TokenizerError(f"{path}: not a JSON object")
  return config


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
    path: a tokenizer.json or a directory with one (a Hugging Face checkpoint, whose
      tokenizer_config.json is read too); "" = the shipped tiny tokenizer.
    special_ids: the id table to check against: "qwen3_5" (the real vocabulary), "tiny", or
      "auto" (read from the checkpoint's own files: `special_ids_from_files`).
  """
  path = resolve_path(path or TINY_TOKENIZER_PATH)
  if special_ids not in _EXPECTED and special_ids != AUTO:
    raise TokenizerError(f"unknown special_ids table {special_ids!r}; one of "
                         f"{sorted(_EXPECTED) + [AUTO]}")
  try:
    hf = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # the Rust side raises plain Exception on a bad file
    raise TokenizerError(f"cannot read tokenizer {path}: {e}") from e
  config = read_tokenizer_config(path)
  if special_ids == AUTO:
    expected = special_ids_from_files(hf, config, path)
  else:
    expected = _EXPECTED[special_ids]
    check_special_ids(hf, expected, path)
  return Tokenizer(hf, SpecialIds.from_table(expected), path, config)


def from_config(tok_cfg) -> Tokenizer:
  """Loads the tokenizer named by the `tokenizer` config section."""
  return load_tokenizer(tok_cfg.path, tok_cfg.special_ids)
