"""The Qwen3.5 chat format in token ids: tokenizer, template pieces, tool-call parsing."""
from envs.chat.format import ChatFormat
from envs.chat.format import ParsedTurn
from envs.chat.format import ToolCall
from envs.chat.template import BadToolCall
from envs.chat.tokenizer import QWEN3_5_SPECIAL_IDS
from envs.chat.tokenizer import SpecialIds
from envs.chat.tokenizer import TINY_SPECIAL_IDS
from envs.chat.tokenizer import Tokenizer
from envs.chat.tokenizer import TokenizerError
from envs.chat.tokenizer import load_tokenizer

__all__ = [
  "ChatFormat",
  "ParsedTurn",
  "ToolCall",
  "BadToolCall",
  "QWEN3_5_SPECIAL_IDS",
  "SpecialIds",
  "TINY_SPECIAL_IDS",
  "Tokenizer",
  "TokenizerError",
  "load_tokenizer",
]
