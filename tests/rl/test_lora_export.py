"""The exports of a LoRA run: the adapters in the PEFT layout pointing at the base's Hugging Face
directory, the merged model, and the base itself when it has no directory of its own."""
import json
import os
import sys

import jax
import numpy as np

from envs.chat import hf_export
from models import lora
from models import qwen3_5
from models import sharding
from rl import lora_export
from rl import train_step
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_utils  # noqa: E402


def _step(**overrides):
  c = train_utils.small_config(**{"lora.rank": 4, "lora.alpha": 8.0}, **overrides)
  with c.mesh.unlocked():
    c.mesh.shape = (1, 1, 1, 1)
  step = train_step.TrainStep(c, sharding.make_mesh(c.mesh, devices=jax.devices()[:1]))
  step.set_base(step.init_base(jax.random.key(0)))
  adapters = jax.tree_util.tree_map_with_path(
      lambda p, x: 0.05 * np.ones(x.shape, np.float32) if p[-1].key == "b" else x,
      jax.device_get(step.init_state(jax.random.key(1))["params"]))
  return c, step, adapters


def _assert_loads_as(path, want):
  _, got = qwen3_5.load_hf(path)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.device_get(want))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_seeded_base_is_written_beside_the_adapters_and_the_merged_model(tmp_path):
  c, step, adapters = _step(**{"lora.export_dir": str(tmp_path / "out")})
  paths = lora_export.export_lora(c, step, adapters)
  assert set(paths) == {"adapter", "merged", "base"}
  with open(os.path.join(paths["adapter"], "adapter_config.json")) as f:
    assert json.load(f)["base_model_name_or_path"] == os.path.abspath(paths["base"])
  assert os.path.exists(os.path.join(paths["adapter"], "adapter_model.safetensors"))
  _assert_loads_as(paths["base"], step.base)
  _assert_loads_as(paths["merged"], lora.merge(jax.device_get(step.base), adapters,
                                               step.lora.scale))


def test_adapters_of_a_run_started_from_a_checkpoint_point_at_it(tmp_path):
  c, step, adapters = _step()
  base_dir = hf_export.save_hf(step.model_cfg, jax.device_get(step.base), str(tmp_path / "ckpt"))
  with c.unlocked():
    c.train.init_from = base_dir
    c.lora.export_dir = str(tmp_path / "out")
  paths = lora_export.export_lora(c, step, adapters)
  assert set(paths) == {"adapter", "merged"}
  with open(os.path.join(paths["adapter"], "adapter_config.json")) as f:
    assert json.load(f)["base_model_name_or_path"] == os.path.abspath(base_dir)
