"""The tokenizer side of a Hugging Face checkpoint directory: tokenizer.json,
tokenizer_config.json (control tokens, end of sequence, padding, chat template) and the
generation defaults, so `AutoTokenizer` and `generate` need nothing else. `save_hf` writes the
whole directory: the model's weights and config (models.qwen3_5.save_hf) plus these files.

The chat template written is the checkpoint's own when the tokenizer came from one that has
a template, else the one Qwen3.5 is published with (`qwen3_5_chat_template.jinja`, kept
verbatim). Where our chat format (`envs.chat.template`) renders differently from that
template, docs/hf_export.md says where and why; tests/envs/test_chat_template_hf.py checks
the two token for token.
"""
import json
import os
import re
from typing import Any, Mapping

from envs.chat import tokenizer as tok_lib
from envs.chat.tokenizer import Tokenizer
from models import qwen3_5
from models.config import ModelConfig

# Qwen's published Qwen3.5 chat template, verbatim. Source: the Hugging Face Hub releases
# Qwen/Qwen3.5-27B (tokenizer_config.json, "chat_template") and Qwen/Qwen3.5-4B
# (chat_template.jinja); this copy is the string literal `_QWEN_CHAT_TEMPLATE` of
# github.com/anhvth/llm-loadbalancer, src/llm_loadbalancer/tools/convert_to_sft_data.py
# (commit 5051f4b, "extracted from Qwen/Qwen3.5-27B tokenizer_config.json"), and it equals the
# "Qwen/Qwen3.5-4B" template of github.com/huggingface/huggingface.js,
# packages/jinja/test/e2e.test.js (commit f9f7b30) once the `\n` escapes inside its string
# literals are written as the newlines they stand for. sha256 a4aee8af...c28f715.
QWEN3_5_CHAT_TEMPLATE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "qwen3_5_chat_template.jinja")
QWEN3_5_CHAT_TEMPLATE_SHA256 = (
    "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715")

# Generation defaults when the caller names none: plain sampling from the model's distribution,
# as configs/base.py's rollout defaults (temperature 1.0, top_p 1.0, top_k 0 = off).
DEFAULT_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def qwen3_5_chat_template() -> str:
  """Qwen3.5's published chat template (Jinja), exactly as released."""
  with open(QWEN3_5_CHAT_TEMPLATE_PATH, encoding="utf-8", newline="") as f:
    return f.read()


# The published template writes a tool call's arguments with `tool_call.arguments|items`, which
# fails (a TypeError in transformers) on arguments given as a JSON string, the OpenAI wire form
# clients send. The export renders such a string as the same arguments given as a mapping
# (`json_arguments.jinja`'s macros, prepended; docs/hf_export.md).
JSON_ARGUMENTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "json_arguments.jinja")
_ARGUMENTS_LOOP = "{%- for args_name, args_value in tool_call.arguments|items %}"
_ARGUMENTS_IF = "{%- if tool_call.arguments is defined %}"


def with_json_string_arguments(template: str) -> str:
  """`template` taking tool-call arguments as a JSON string too, rendered as the same mapping:
  the published template's `arguments` loop guarded by a branch for strings. A template that
  lacks that loop, or already has the branch, is returned as it is."""
  with open(JSON_ARGUMENTS_PATH, encoding="utf-8", newline="") as f:
    macros = f.read()
  hook = re.search(re.escape(_ARGUMENTS_IF) + r"\s*" + re.escape(_ARGUMENTS_LOOP), template)
  if hook is None or "qwen35rl_json_arguments" in template:
    return template
  branch = ("{%- if tool_call.arguments is defined and tool_call.arguments is string %}"
            "{{- qwen35rl_json_arguments(tool_call.arguments) }}"
            "{%- elif tool_call.arguments is defined %}")
  at = hook.start()
  return macros + template[:at] + branch + template[at + len(_ARGUMENTS_IF):]


def chat_template(tokenizer: Tokenizer) -> str:
  """The template an export carries: the source checkpoint's own, else Qwen3.5's, taking
  tool-call arguments as a JSON string as well as a mapping (`with_json_string_arguments`)."""
  own = tokenizer.config.get("chat_template")
  if isinstance(own, str) and own:
    return with_json_string_arguments(own)
  return with_json_string_arguments(qwen3_5_chat_template())


def _token(tok) -> dict[str, Any]:
  return {"content": tok.content, "lstrip": tok.lstrip, "normalized": tok.normalized,
          "rstrip": tok.rstrip, "single_word": tok.single_word, "special": tok.special}


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int) -> dict[str, Any]:
  """tokenizer_config.json: the added tokens by id, the chat's end-of-sequence token
  (`<|im_end|>`, where a turn stops), padding (`<|endoftext|>`), no BOS, and the template.

  `PreTrainedTokenizerFast` takes tokenizer.json as it is (normalizer, pre-tokenizer, merges):
  what `transformers` encodes is then what `Tokenizer.encode` encodes."""
  sp = tokenizer.special
  added = tokenizer.added_tokens()
  return {
      "added_tokens_decoder": {str(i): _token(t) for i, t in added.items()},
      "bos_token": None,
      "chat_template": chat_template(tokenizer),
      "clean_up_tokenization_spaces": False,
      "eos_token": added[sp.im_end].content,
      "errors": "replace",
      "model_max_length": int(model_max_length),
      "pad_token": added[sp.endoftext].content,
      "split_special_tokens": False,
      "tokenizer_class": "PreTrainedTokenizerFast",
      "unk_token": None,
  }


def generation_config(tokenizer: Tokenizer,
                      sampling: Mapping[str, float] | None = None) -> dict[str, Any]:
  """generation_config.json: stop at the end of a turn or of the text (the chat format's stop
  ids), pad with `<|endoftext|>`, and sample with `sampling` (temperature, top_p, top_k; 0 =
  no top-k) over DEFAULT_SAMPLING; temperature 0 = greedy."""
  s = dict(DEFAULT_SAMPLING, **(sampling or {}))
  unknown = set(s) - set(DEFAULT_SAMPLING)
  if unknown:
    raise ValueError(f"unknown sampling settings {sorted(unknown)}; "
                     f"one of {sorted(DEFAULT_SAMPLING)}")
  sp = tokenizer.special
  out = {"bos_token_id": None, "eos_token_id": list(sp.stop_ids), "pad_token_id": sp.endoftext}
  if float(s["temperature"]) <= 0:
    return dict(out, do_sample=False)
  return dict(out, do_sample=True, temperature=float(s["temperature"]), top_k=int(s["top_k"]),
              top_p=float(s["top_p"]))


def _write_json(path: str, obj) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, ensure_ascii=False)
    f.write("\n")


def write(path: str, tokenizer: Tokenizer, vocab_size: int, model_max_length: int,
          sampling: Mapping[str, float] | None = None) -> None:
  """Writes tokenizer.json, tokenizer_config.json and generation_config.json into `path`.

  Args:
    path: the checkpoint directory.
    tokenizer: the model's tokenizer.
    vocab_size: the model's embedding rows; every token id must have one.
    model_max_length: the longest context the model takes.
    sampling: generation defaults over DEFAULT_SAMPLING.
  """
  if tokenizer.vocab_size > vocab_size:
    raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                     f"{vocab_size} embedding rows")
  with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8", newline="") as f:
    f.write(tokenizer.to_json())
  _write_json(os.path.join(path, "tokenizer_config.json"),
              tokenizer_config(tokenizer, model_max_length))
  _write_json(os.path.join(path, "generation_config.json"),
              generation_config(tokenizer, sampling))


def resolve_tokenizer(vocab_size: int, tokenizer="") -> Tokenizer | None:
  """`save_hf`'s tokenizer argument -> a Tokenizer, or None for no tokenizer files."""
  if tokenizer is None or isinstance(tokenizer, Tokenizer):
    return tokenizer
  if tokenizer:
    return tok_lib.load_tokenizer(tokenizer, tok_lib.AUTO)
  tiny = tok_lib.load_tokenizer("", "tiny")
  return tiny if tiny.vocab_size == vocab_size else None


def save_hf(cfg: ModelConfig, params, path: str, tokenizer="",
            sampling: Mapping[str, float] | None = None, **kw) -> str:
  """A Hugging Face checkpoint directory transformers uses without help: the weights and a
  text-only config.json (models.qwen3_5.save_hf; `max_shard_bytes=`), the tokenizer and the
  generation defaults.

  Args:
    tokenizer: the model's tokenizer, or a path to a tokenizer.json or a checkpoint directory
      holding one (its control ids are read from its files, and its own chat template, if any,
      is kept); "" = the shipped tiny tokenizer when its vocabulary is the model's, else none;
      None = no tokenizer or generation files.
    sampling: generation defaults (temperature, top_p, top_k) for generation_config.json.
  """
  tok = resolve_tokenizer(cfg.vocab_size, tokenizer)
  extras = None if tok is None else (
      lambda p: write(p, tok, cfg.vocab_size, cfg.max_position_embeddings, sampling))
  return qwen3_5.save_hf(cfg, params, path, extras=extras, **kw)
