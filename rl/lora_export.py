"""The exports of a LoRA run (lora.export_dir, docs/lora.md): Hugging Face checkpoints written at
the end of --mode=rl.

  <export_dir>/adapter   the adapters in the PEFT layout (models/hf_lora.py), for
                         peft.PeftModel.from_pretrained on the base's transformers model
  <export_dir>/merged    the base with the adapters merged: a full checkpoint
  <export_dir>/base      the base, when it has no Hugging Face directory of its own (the SFT
                         result without sft.export_hf, or the seeded init)

adapter_config.json's base_model_name_or_path names the base's directory: train.init_from when
RL started from it, sft.export_hf for an exported SFT result, else <export_dir>/base.
"""
from __future__ import annotations

import os

import jax

from envs.chat import hf_export
from models import hf_lora
from models import lora
from rl import distributed
from rl.run_files import starts_from_sft
from rl.sft import hf_export_settings


def base_directory(config) -> str:
  """The Hugging Face directory of the run's base, or "" when it has none."""
  if starts_from_sft(config):
    return config.sft.export_hf
  return config.train.init_from


def export_lora(config, step_fn, adapters) -> dict:
  """Writes the exports of `adapters` over `step_fn.base`; returns {what: directory}. Every
  process calls it (the gathers are collectives); process 0 writes."""
  out_dir = config.lora.export_dir
  base = distributed.host_copy(step_fn.base)
  adapters = distributed.host_copy(adapters)
  if not distributed.is_writer():
    return {}
  base, adapters = jax.device_get(base), jax.device_get(adapters)
  cfg, spec = step_fn.model_cfg, step_fn.lora
  settings = hf_export_settings(config)
  paths = {"adapter": os.path.join(out_dir, "adapter"), "merged": os.path.join(out_dir, "merged")}
  base_dir = base_directory(config)
  if not base_dir:
    base_dir = paths["base"] = os.path.join(out_dir, "base")
    hf_export.save_hf(cfg, base, base_dir, **settings)
  hf_lora.save_peft(cfg, spec, adapters, paths["adapter"], base_model=os.path.abspath(base_dir))
  hf_export.save_hf(cfg, jax.jit(lambda p, a: lora.merge(p, a, spec.scale))(base, adapters),
                    paths["merged"], **settings)
  return paths
