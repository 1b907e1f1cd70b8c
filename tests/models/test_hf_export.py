"""save_hf writes a directory the Hugging Face stack uses without help (docs/hf_export.md)."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from configs import tiny_cpu
from envs.chat import ChatFormat
from envs.chat import hf_export
from envs.chat import load_tokenizer
from models import hf_io
from models import qwen3_5
from rl import params_io
from rl.sft import hf_export_settings

BASE = tiny_cpu.BASE_CHECKPOINT


def _tool(name, *required):
  return {"type": "function", "function": {"name": name, "parameters": {
      "type": "object", "properties": {k: {"type": "string"} for k in required},
      "required": list(required)}}}


# The compact schemas of the tiny default's seven tools (configs/tiny_cpu.py, loop.tools).
TOOLS = [_tool("documents_read_document", "path"), _tool("pdfs_read_pdf", "path"),
         _tool("spreadsheets_read_sheet", "path"), _tool("presentations_read_presentation", "path"),
         _tool("mail_search_messages", "query"), _tool("chat_read_channel", "channel"),
         _tool("calendar_list_events")]
TASK = [{"role": "user", "content": "You work at Northwind Traders. According to "
                                    "/reports/acme-corp.pdf, what is the founded of Acme Corp?"}]


@pytest.fixture(scope="module")
def tiny():
  return qwen3_5.load_hf(BASE)


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory):
  cfg, params = tiny
  return hf_export.save_hf(cfg, params, str(tmp_path_factory.mktemp("tiny") / "hf"),
                           **hf_export_settings(tiny_cpu.get_config()))


def _greedy(cfg, params, prompt, stop_ids, max_new):
  """Our own greedy decoding: the model's prefill and decode steps (what the engine runs)."""
  prefill = jax.jit(qwen3_5.prefill, static_argnums=(0, 4))
  step = jax.jit(qwen3_5.decode_step, static_argnums=0)
  logits, cache = prefill(cfg, params, jnp.asarray([prompt], jnp.int32),
                          jnp.asarray([len(prompt)], jnp.int32), len(prompt) + max_new)
  out = []
  while len(out) < max_new:
    out.append(int(jnp.argmax(logits[0])))
    if out[-1] in stop_ids:
      break
    logits, cache = step(cfg, params, cache, jnp.asarray(out[-1:], jnp.int32))
  return out


def test_transformers_loads_chats_and_generates_from_the_directory_alone(tiny, exported):
  tok = transformers.AutoTokenizer.from_pretrained(exported)
  model, info = transformers.AutoModelForCausalLM.from_pretrained(exported,
                                                                  output_loading_info=True)
  assert type(model).__name__ == "Qwen3_5MoeForCausalLM"   # the text model, no vision tower
  assert not any(info.values()), info                      # every weight, nothing left over
  assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == [2, 0]

  # The tiny default trains with thinking off: its prompts end in an empty think block.
  enc = tok.apply_chat_template(TASK, tools=TOOLS, add_generation_prompt=True,
                                enable_thinking=False, return_dict=True, return_tensors="pt")
  prompt = enc["input_ids"][0].tolist()
  fmt = ChatFormat(load_tokenizer(exported, "auto"), thinking=False)
  assert prompt == fmt.prompt_ids(TOOLS, TASK[0]["content"])
  with torch.no_grad():
    out = model.generate(**enc, do_sample=False, max_new_tokens=48)
  theirs = out[0, len(prompt):].tolist()
  # It stopped at the end of the turn, well before max_new_tokens.
  assert theirs[-1] == tok.convert_tokens_to_ids("<|im_end|>") and len(theirs) < 48
  assert tok.decode(theirs) == ("<tool_call>\n<function=pdfs_read_pdf>\n<parameter=path>\n"
                                "/reports/acme-corp.pdf\n</parameter>\n</function>\n"
                                "</tool_call><|im_end|>")
  cfg, params = tiny
  assert _greedy(cfg, params, prompt, fmt.stop_ids, 48) == theirs


def test_directory_holds_a_text_config_the_tokenizer_and_generation_defaults(exported):
  assert sorted(os.listdir(exported)) == [
      "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
      "tokenizer_config.json"]
  with open(os.path.join(exported, "config.json")) as f:
    config = json.load(f)
  assert config["architectures"] == ["Qwen3_5MoeForCausalLM"]
  assert config["model_type"] == "qwen3_5_moe_text" and "text_config" not in config
  assert type(transformers.AutoConfig.from_pretrained(exported)).__name__ == "Qwen3_5MoeTextConfig"
  with open(os.path.join(exported, "tokenizer_config.json")) as f:
    tok_config = json.load(f)
  assert tok_config["chat_template"] == hf_export.with_json_string_arguments(
      hf_export.qwen3_5_chat_template())
  assert (tok_config["eos_token"], tok_config["pad_token"]) == ("<|im_end|>", "<|endoftext|>")
  with open(os.path.join(exported, "generation_config.json")) as f:
    gen = json.load(f)
  # The stop ids come from the tokenizer, the sampling defaults from the config (rollout.*).
  assert gen == {"bos_token_id": None, "eos_token_id": [2, 0], "pad_token_id": 0,
                 "do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def test_dense_models_name_the_dense_class(tmp_path):
  c = tiny_cpu.get_config()
  cfg = qwen3_5.config_from_dict(c.model).replace(use_moe=False, intermediate_size=48,
                                                 num_experts=0, num_experts_per_tok=0,
                                                 moe_intermediate_size=0,
                                                 shared_expert_intermediate_size=0)
  params = qwen3_5.init_params(cfg, jax.random.key(0))
  path = hf_export.save_hf(cfg, params, str(tmp_path / "dense"))
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  assert (config["architectures"], config["model_type"]) == (["Qwen3_5ForCausalLM"],
                                                             "qwen3_5_text")
  model = transformers.AutoModelForCausalLM.from_pretrained(path)
  assert type(model).__name__ == "Qwen3_5ForCausalLM"
  tokens = np.arange(1, 13, dtype=np.int32)[None]
  with torch.no_grad():
    ref = model(torch.from_numpy(tokens).long()).logits.numpy()
  np.testing.assert_allclose(np.asarray(qwen3_5.forward(cfg, params, jnp.asarray(tokens))), ref,
                             atol=1e-4, rtol=0)


def test_the_old_hub_layout_still_loads_to_the_same_params(tiny, exported, tmp_path):
  old = tmp_path / "old"
  shutil.copytree(exported, old)
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    os.remove(old / name)
  with open(old / "config.json", "w") as f:
    json.dump(hf_io.hub_config_dict(tiny[0]), f, indent=1)
  cfg_old, params_old = qwen3_5.load_hf(str(old))
  cfg_new, params_new = qwen3_5.load_hf(exported)
  assert cfg_old == cfg_new == tiny[0]
  jax.tree.map(np.testing.assert_array_equal, params_old, params_new)
  jax.tree.map(np.testing.assert_array_equal, params_new, tiny[1])
  # The start fingerprint of a run follows the weights and model config, not the metadata.
  c = tiny_cpu.get_config()
  prints = []
  for path in (str(old), exported, BASE):
    with c.unlocked():
      c.train.init_from = path
    prints.append(params_io.start_fingerprint(c))
  assert prints[0] == prints[1] == prints[2]


def test_the_shipped_tiny_base_is_what_save_hf_writes(tiny, exported):
  """assets/tiny_base is save_hf's output for its own weights, file for file, byte for byte."""
  assert sorted(os.listdir(BASE)) == sorted(os.listdir(exported))
  for name in os.listdir(BASE):
    with open(os.path.join(BASE, name), "rb") as a, open(os.path.join(exported, name), "rb") as b:
      assert a.read() == b.read(), name
