"""Memory planner (launch.py --mode=plan): the attention-score term follows the attention
strategy the model config picks."""
import importlib

import pytest

from configs import tiny_cpu
from models import qwen3_5
from rl import plan


def _scores(**model):
  mc = qwen3_5.config_from_dict(tiny_cpu.get_config().model).replace(
      attention_query_chunk=0, attention_causal_block=0)
  return plan.activation_bytes(mc.replace(**model), 2048, 4.0, 1)["attn_scores"]


def test_causal_blocks_hold_the_lower_triangle_of_scores():
  full = _scores()
  # 2048 / 512 = 4 blocks: (4 + 1) / (2 * 4) of the square.
  assert _scores(attention_causal_block=512) == pytest.approx(full * 5 / 8)
  assert _scores(attention_causal_block=4096) == full     # one block: the whole square


def test_query_chunks_hold_one_block_of_scores():
  assert _scores(attention_query_chunk=256) == pytest.approx(_scores() / 8)
  # The query-chunked path takes precedence when both are set (as in the model).
  assert _scores(attention_query_chunk=256, attention_causal_block=512) == \
      _scores(attention_query_chunk=256)


def test_context_parallel_splits_a_rows_activations_over_its_devices():
  mc = qwen3_5.config_from_dict(tiny_cpu.get_config().model)
  whole = plan.activation_bytes(mc, 2048, 1.0, 1)
  split = plan.activation_bytes(mc, 2048, 1.0, 1, length_ways=4)
  for k in ("saved", "attn_scores", "logits"):
    assert split[k] == pytest.approx(whole[k] / 4)
  # Attention also holds the row's keys and values, gathered from the 4 devices.
  assert whole["working"] / 4 < split["working"] < whole["working"] / 2


@pytest.mark.parametrize("name", ["qwen3_5_35b_a3b", "qwen3_5_397b_a17b"])
def test_full_size_configs_fit_a_row_of_the_whole_context(name):
  c = importlib.import_module(f"configs.{name}").get_config()
  assert c.train.seq_len >= c.train.max_context
  p = plan.memory_plan(c, c.plan.num_devices, [c.train.seq_len])
  per_device = p["params"] + p["grads"] + p["opt"] + p["activations"][0][1]["total"]
  assert p["length_ways"] > 1
  assert per_device <= 0.95 * c.plan.device_memory_gib * plan.GiB


def test_the_kl_reference_costs_one_more_copy_of_the_params_per_device():
  c = importlib.import_module("configs.qwen3_5_35b_a3b").get_config()
  off = plan.memory_plan(c, c.plan.num_devices, [c.train.seq_len])
  with c.unlocked():
    c.rl.kl.coef = 0.01
  on = plan.memory_plan(c, c.plan.num_devices, [c.train.seq_len])
  assert off["ref_params"] == 0 and on["ref_params"] == on["params"] > 0
  assert "reference params (KL)" in plan.format_plan(c, on)
  assert "reference params (KL)" not in plan.format_plan(c, off)
