"""A full-size config's named layout (`--config=configs/X.py:LAYOUT`, big_vision's get_config
argument) resolves as launch.py resolves it, and an unknown one is an error naming the choices."""
import os

from absl import flags
from ml_collections import config_flags
import pytest

from models import sharding
from rl import plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _resolve(config_arg: str):
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", os.path.join(ROOT, config_arg),
                                           flag_values=fv, lock_config=True)
  fv(["launch.py"])
  return holder.value


def test_the_397b_v5p512_layout_splits_rows_over_64_chips_and_weights_over_all():
  c = _resolve("configs/qwen3_5_397b_a17b.py:v5p512")
  assert tuple(c.mesh.shape) == (4, 8, 8, 1) and c.plan.num_devices == 256
  embed = [t for name, t in sharding.rules_from_config(c.mesh.rules) if name == "embed"]
  assert embed == [("data", "fsdp", "expert"), ("data", "fsdp")]
  assert sharding.rule_axes(c.mesh.rules, "activation_length") == ("fsdp", "expert")
  rows = c.train.prompts_per_step * c.train.samples_per_prompt
  assert rows // c.train.micro_batches == 4          # one row a `data` group
  # The plan of the layout: weights and optimizer state split over all 256 chips, a quarter of
  # the 64-H200 layout's; the step runs the micro-batches the config names.
  here, h200 = (plan.memory_plan(x, x.plan.num_devices, [8192]) for x in (
      c, _resolve("configs/qwen3_5_397b_a17b.py")))
  assert 0.2 < here["params"] / h200["params"] < 0.3
  assert here["micro_batches"] == c.train.micro_batches


def test_the_35b_rows_split_within_a_node_on_h200s_and_over_all_16_chips_of_a_v5p_slice():
  """On 2 nodes of 8 H200 each row is split over one node's GPUs (`expert`) and the micro-batch's
  two rows go one to a node (`fsdp`), so the sequence mixers' all-to-alls stay within a node;
  the `v5p` layout splits each row over all 16 chips, the same per-device activations."""
  c = _resolve("configs/qwen3_5_35b_a3b.py")
  assert sharding.rule_axes(c.mesh.rules, "activation_length") == ("expert",)
  assert sharding.rule_axes(c.mesh.rules, "batch") == ("data", "fsdp")
  v5p = _resolve("configs/qwen3_5_35b_a3b.py:v5p")
  assert sharding.rule_axes(v5p.mesh.rules, "activation_length") == ("fsdp", "expert")
  assert v5p.plan.device_kind == "TPU v5p" and v5p.plan.device_memory_gib == 95
  gpu, tpu = (plan.memory_plan(x, 16, [163_840]) for x in (c, v5p))
  assert gpu["micro_batches"] == tpu["micro_batches"] == c.train.micro_batches
  assert abs(gpu["activations"][0][1]["total"] / tpu["activations"][0][1]["total"] - 1) < 0.05
  with pytest.raises(Exception, match="v5p"):
    _resolve("configs/qwen3_5_35b_a3b.py:tpu")


def test_an_unknown_layout_names_the_known_ones():
  with pytest.raises(Exception, match="v5p512"):
    _resolve("configs/qwen3_5_397b_a17b.py:v5p1024")


def test_the_397b_h200x128_layout_splits_rows_over_64_gpus_two_side_by_side():
  c = _resolve("configs/qwen3_5_397b_a17b.py:h200x128")
  assert tuple(c.mesh.shape) == (2, 8, 8, 1) and c.plan.num_devices == 128
  embed = [t for name, t in sharding.rules_from_config(c.mesh.rules) if name == "embed"]
  assert embed == [("data", "fsdp", "expert"), ("data", "fsdp")]
  rows = c.train.prompts_per_step * c.train.samples_per_prompt
  assert rows // c.train.micro_batches == 2          # one row a `data` group
  assert c.plan.device_kind == _resolve("configs/qwen3_5_397b_a17b.py").plan.device_kind
