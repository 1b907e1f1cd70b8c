"""Memory plan with LoRA: a frozen base with no gradients or optimizer state, the adapters'
float32 masters, gradients and moments, and the merged weights the layer scan makes."""
import jax

from configs import base
from models import lora
from models import qwen3_5
from rl import plan


def _config(**overrides):
  c = base.get_config()
  c.update_from_flattened_dict(overrides)
  return c


def _sizes():
  mc = qwen3_5.config_from_dict(base.get_config().model)
  shapes = jax.eval_shape(lambda k: qwen3_5.init_params(mc, k), jax.random.key(0))
  spec = lora.from_config(_config(**{"lora.rank": 4}).lora)
  adapters = jax.eval_shape(lambda k: lora.init(spec, qwen3_5.param_axes(mc), shapes, k),
                            jax.random.key(0))
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  adapted = {p for p in lora.adapted_paths(spec, qwen3_5.param_axes(mc))}
  merged = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(shapes)
               if jax.tree_util.keystr(p, simple=True, separator="/") in adapted)
  return count(shapes), count(adapters), merged, mc.num_cycles


def test_lora_plan_holds_the_base_once_and_trains_only_the_adapters():
  n_base, n_adapters, n_merged, cycles = _sizes()
  full = plan.memory_plan(_config(**{"rl.kl.coef": 0.1}), 1)
  lo = plan.memory_plan(_config(**{"rl.kl.coef": 0.1, "lora.rank": 4,
                                   "model.param_dtype": "bfloat16"}), 1)
  assert full["params"] == full["grads"] == 4 * n_base and full["opt"] == 8 * n_base
  assert full["ref_params"] == 4 * n_base          # the KL reference: a second copy
  assert lo["params"] == 2 * n_base + 4 * n_adapters   # bfloat16 base + float32 adapters
  assert lo["grads"] == 4 * n_adapters and lo["opt"] == 8 * n_adapters
  assert lo["ref_params"] == 0                     # the reference is the base, adapters off
  # remat none: every layer's merged weights kept for the backward pass (in the base's dtype).
  assert lo["activations"][0][1]["lora_merged"] == 2 * n_merged
  remat = plan.memory_plan(_config(**{"lora.rank": 4, "model.remat": "full"}), 1)
  assert remat["activations"][0][1]["lora_merged"] == 4 * n_merged // cycles


def test_plan_prints_the_frozen_base_and_the_adapters():
  c = _config(**{"lora.rank": 4})
  text = plan.format_plan(c, plan.memory_plan(c, 1))
  assert "params (frozen base)" in text and "LoRA adapters (float32)" in text
  assert "gradients (adapters)" in text
