"""LoRA adapters (models/lora.py) in the PEFT layout: `adapter_config.json` and
`adapter_model.safetensors` that `peft.PeftModel.from_pretrained` loads onto the transformers
model of the base checkpoint (docs/lora.md).

Names and layouts. A projection stored in transformers as torch [out, in] (ours [in..., out...]
flattened and transposed, models/hf_io.py) gets `lora_A.weight` [r, in] = A^T and
`lora_B.weight` [out, r] = B^T: PEFT's update scaling * lora_B @ lora_A is then the transpose
of ours. The routed experts are fused 3-D parameters in transformers (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]), which PEFT adapts through `target_parameters`
with one rank-r pair per expert, laid out as lora_A [E * r, in] (expert-major rows) and lora_B
[out, r * E] (rank-major columns); the router, a module of its own rather than a Linear, is
adapted through `target_parameters` too (its 2-D weight: lora_A [r, in], lora_B [out, r]). Our gate and up adapters are two rank-r pairs; on the fused
gate_up they are one rank-2r pair per expert (A stacked, B block-diagonal). PEFT takes one rank
for all targets here, so every pair is written at the largest rank needed, padded with zeros
(which adds nothing to A @ B), and lora_alpha = (our alpha / r) x that rank keeps the scale.
"""
import json
import os

import jax
import numpy as np
from safetensors.numpy import save_file

from models import hf_io
from models import lora
from models.config import ModelConfig

def _pad_rank(a_t, b_t, rank):
  """lora_A [r, in], lora_B [out, r] padded with zeros to `rank`."""
  r = a_t.shape[0]
  return (np.pad(a_t, [(0, rank - r), (0, 0)]), np.pad(b_t, [(0, 0), (0, rank - r)]))


def _dense_pair(pair, rank):
  """One layer's (a [in..., r], b [r, out...]) -> (lora_A [rank, in], lora_B [out, rank])."""
  a, b = np.asarray(pair["a"], np.float32), np.asarray(pair["b"], np.float32)
  r = a.shape[-1]
  return _pad_rank(a.reshape(-1, r).T, b.reshape(r, -1).T, rank)


def _expert_pairs(pairs, rank):
  """Per-expert (A_e [k, in], B_e [out, k]) of one fused parameter -> PEFT's (lora_A
  [E * rank, in], lora_B [out, rank * E]). `pairs`: per expert, a list of (A_e, B_e) blocks
  whose B rows follow each other (gate then up) and whose ranks add up."""
  a_blocks, b_blocks = [], []
  for blocks in pairs:
    ins = blocks[0][0].shape[1]
    outs = sum(b.shape[0] for _, b in blocks)
    a_e = np.zeros((rank, ins), np.float32)
    b_e = np.zeros((outs, rank), np.float32)
    k = o = 0
    for a, b in blocks:
      a_e[k:k + a.shape[0]] = a
      b_e[o:o + b.shape[0], k:k + a.shape[0]] = b
      k, o = k + a.shape[0], o + b.shape[0]
    a_blocks.append(a_e)
    b_blocks.append(b_e)
  lora_a = np.concatenate(a_blocks, axis=0)                       # [E * rank, in]
  lora_b = np.stack(b_blocks, axis=-1).reshape(b_blocks[0].shape[0], -1)   # [out, rank * E]
  return lora_a, lora_b


def _expert_blocks(ffn, c, cfg):
  """{"gate_up_proj": per expert [(A, B) ...], "down_proj": ...} of layer cycle `c` (only the
  fused parameters that have an adapter; a missing half of gate_up is a zero block)."""
  out = {}
  e_count, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
  get = lambda name, e: (np.asarray(ffn[name]["a"][c, e], np.float32).T,     # [r, in]
                         np.asarray(ffn[name]["b"][c, e], np.float32).T)     # [out, r]
  if "wi_gate" in ffn or "wi_up" in ffn:
    zero = (np.zeros((0, h), np.float32), np.zeros((i, 0), np.float32))
    out["gate_up_proj"] = [[get(n, e) if n in ffn else zero for n in ("wi_gate", "wi_up")]
                           for e in range(e_count)]
  if "wo" in ffn:
    out["down_proj"] = [[get("wo", e)] for e in range(e_count)]
  return out


def peft_rank(spec: lora.LoraSpec, adapters: dict) -> int:
  """The one rank of the export: 2r where a layer adapts both halves of the fused gate_up."""
  both = any("wi_gate" in b.get("ffn", {}) and "wi_up" in b.get("ffn", {})
             for b in adapters["blocks"])
  return 2 * spec.rank if both else spec.rank


def peft_tensors(cfg: ModelConfig, spec: lora.LoraSpec, adapters: dict):
  """({PEFT key: array}, target module names, target parameter names, rank)."""
  adapters = jax.device_get(adapters)
  rank = peft_rank(spec, adapters)
  tensors, modules, params = {}, [], []
  for j, layer_type in enumerate(cfg.cycle):
    block, names = adapters["blocks"][j], hf_io.module_names(cfg, layer_type)
    for c in range(cfg.num_cycles):
      layer = f"model.layers.{hf_io.layer_index(cfg, j, c)}."
      for our, hf in names.items():
        pair = block.get(our[0], {}).get(our[1])
        if pair is None:
          continue
        one = jax.tree.map(lambda x: x[c], pair)
        a_t, b_t = _dense_pair(one, rank)
        tensors[f"base_model.model.{layer}{hf}.lora_A.weight"] = a_t
        tensors[f"base_model.model.{layer}{hf}.lora_B.weight"] = b_t
        if our == ("ffn", "router"):   # a router module, not a Linear: its weight parameter
          params.append(f"{layer}{hf}.weight")
        else:
          modules.append(layer + hf)
      fused = _expert_blocks(block.get("ffn", {}), c, cfg) if cfg.use_moe else {}
      # PEFT nests two wrappers of one module in target_parameters' order: the first listed
      # is the inner one, its keys under `base_layer.`.
      for n, name in enumerate(fused):
        inner = "base_layer." if n == 0 and len(fused) == 2 else ""
        lora_a, lora_b = _expert_pairs(fused[name], rank)
        tensors[f"base_model.model.{layer}mlp.experts.{inner}lora_A.weight"] = lora_a
        tensors[f"base_model.model.{layer}mlp.experts.{inner}lora_B.weight"] = lora_b
        params.append(f"{layer}mlp.experts.{name}")
  return tensors, modules, params, rank


def save_peft(cfg: ModelConfig, spec: lora.LoraSpec, adapters: dict, path: str,
              base_model: str = "") -> str:
  """Writes `path`/adapter_config.json and adapter_model.safetensors; `base_model`: the
  Hugging Face directory of the base the adapters apply to (recorded in the config)."""
  tensors, modules, params, rank = peft_tensors(cfg, spec, adapters)
  os.makedirs(path, exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
      "r": rank, "lora_alpha": spec.scale * rank, "lora_dropout": 0.0, "bias": "none",
      "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
      # Exact module names, one regex (PEFT full-matches a string target against each name).
      "target_modules": "^(" + "|".join(m.replace(".", r"\.") for m in modules) + ")$"
                        if modules else None,
      "target_parameters": params or None,
  }
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=1)
    f.write("\n")
  return path
