"""Memory planner (launch.py --mode=plan): the attention-score term follows the attention
strategy the model config picks; the activations follow what each layer kind keeps for the
backward pass, the remat setting and the platform the step runs on."""
import importlib

import pytest

from configs import base
from configs import tiny_cpu
from models import qwen3_5
from rl import plan


def _scores(**model):
  mc = qwen3_5.config_from_dict(tiny_cpu.get_config().model).replace(
      attention_query_chunk=0, attention_causal_block=0)
  return plan.activation_bytes(mc.replace(**model), 2048, 4.0, 1)["attn_scores"]


def test_causal_blocks_hold_one_block_of_scores_at_a_time():
  """Each block's scores are recomputed in its backward pass: the largest block, the last
  (512 queries against all 2048 keys), is what is held."""
  full = _scores()
  assert _scores(attention_causal_block=512) == pytest.approx(full * 512 / 2048)
  assert _scores(attention_causal_block=4096) == full     # one block: the whole square


def test_query_chunks_hold_one_block_of_scores():
  assert _scores(attention_query_chunk=256) == pytest.approx(_scores() / 8)
  # The query-chunked path takes precedence when both are set (as in the model).
  assert _scores(attention_query_chunk=256, attention_causal_block=512) == \
      _scores(attention_query_chunk=256)


def test_context_parallel_splits_a_rows_activations_over_its_devices():
  mc = qwen3_5.config_from_dict(tiny_cpu.get_config().model).replace(use_moe=False)
  whole = plan.activation_bytes(mc, 2048, 1.0, 1)
  split = plan.activation_bytes(mc, 2048, 1.0, 1, length_ways=4)
  for k in ("saved", "attn_scores", "logits"):
    assert split[k] == pytest.approx(whole[k] / 4)
  # Attention also holds the row's keys and values, gathered from the 4 devices.
  assert whole["working"] / 4 < split["working"] < whole["working"] / 2


def test_each_devices_moe_rows_are_padded_to_whole_expert_blocks():
  """The MoE dispatches a device's own tokens, each expert's rows padded to whole blocks: a
  quarter of the tokens keep more than a quarter of the rows."""
  mc = qwen3_5.config_from_dict(tiny_cpu.get_config().model)
  whole = plan.part_bytes(mc, 2048, 1.0)["moe"]["kept"]
  split = plan.part_bytes(mc, 2048, 1.0, length_ways=4)["moe"]["kept"]
  assert whole / 4 < split < whole / 2


def _1b(**kw):
  """The shape of benchmarks/accelerator.py's ~1B MoE (benchmarks/activation_memory.py)."""
  m = base.get_model_config()
  m.update(hidden_size=1024, num_hidden_layers=12, vocab_size=32768, num_attention_heads=8,
           num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
           linear_key_head_dim=128, linear_value_head_dim=128, num_experts=64,
           num_experts_per_tok=2, moe_intermediate_size=384, shared_expert_intermediate_size=384,
           param_dtype="bfloat16", dtype="bfloat16")
  return qwen3_5.config_from_dict(m).replace(**kw)


def test_without_remat_every_layer_keeps_its_parts_and_the_peak_adds_the_largest_working_set():
  mc = _1b(remat="none")
  a = plan.activation_bytes(mc, 2048, 8.0, 1, platform="gpu")
  parts = plan.part_bytes(mc, 2048, 8.0, platform="gpu")
  layer = {t: 2 * parts["rms_norm"]["kept"] + parts["moe"]["kept"]
           + parts["gated_deltanet" if t == "linear_attention" else "attention"]["kept"]
           for t in set(mc.layer_types)}
  head = parts["lm_head_logprobs"]["kept"] + parts["rms_norm"]["kept"]
  assert a["saved"] == pytest.approx(sum(layer[t] for t in mc.layer_types) + head)
  assert a["working"] == max(p["working"] for k, p in parts.items() if k != "lm_head_logprobs")
  assert a["total"] == pytest.approx(a["saved"] + max(a["working"], a["logits"]))


def test_full_remat_saves_each_cycles_input_and_holds_one_cycle_recomputed():
  none, full = (plan.activation_bytes(_1b(remat=r), 2048, 8.0, 1, platform="gpu")
                for r in ("none", "full"))
  cycle = none["saved"] * len(_1b().cycle) / _1b().num_hidden_layers     # about one cycle's
  tok, h = 8 * 2048, _1b().hidden_size
  assert full["saved"] < none["saved"] / 10
  assert full["saved"] >= _1b().num_cycles * tok * h * 2
  assert full["working"] == pytest.approx(none["working"] + cycle, rel=0.05)


def test_a_gated_deltanet_layer_not_recomputed_keeps_its_mixers_float32_tensors():
  """model.gdn_recompute=False: each Gated DeltaNet layer keeps ~9 float32 value-sized tensors,
  6 of chunk width and 1.5 of the states a token more (fitted to the compiled layer,
  benchmarks/activation_memory.py), and its backward holds as much less."""
  tok = 8 * 2048
  on, off = (plan.part_bytes(_1b(gdn_recompute=r), 2048, 8.0, platform="gpu")["gated_deltanet"]
             for r in (True, False))
  mc = _1b()
  value = mc.linear_num_value_heads * mc.linear_value_head_dim
  chunk = mc.linear_num_value_heads * 64
  states = mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim / 64
  extra = (9 * value + 6 * chunk + 1.5 * states) * 4 * tok
  assert off["kept"] - on["kept"] == pytest.approx(extra)
  assert on["working"] - off["working"] == pytest.approx(extra)


def test_cudnn_flash_attention_holds_no_scores():
  """On a GPU, bfloat16 attention is cuDNN's flash attention (attention.resolve_impl): only
  its softmax statistics, where XLA's attention holds the square of scores."""
  cudnn = plan.part_bytes(_1b(), 2048, 8.0, platform="gpu")["attention"]["scores"]
  xla = plan.part_bytes(_1b(attention_impl="xla"), 2048, 8.0, platform="gpu")["attention"]
  assert xla["scores"] > 100 * cudnn


def test_xla_cpu_holds_float32_copies_of_16_bit_activations_and_weights():
  cpu, gpu = (plan.activation_bytes(_1b(), 2048, 8.0, 1, platform=p) for p in ("cpu", "gpu"))
  assert cpu["saved"] == pytest.approx(2 * gpu["saved"], rel=0.1)
  assert cpu["cpu_float32_copies"] == 2 * 4 * qwen3_5.count_params(_1b())["total"]
  assert gpu["cpu_float32_copies"] == 0
  f32 = plan.activation_bytes(_1b(dtype="float32", param_dtype="float32"), 2048, 8.0, 1,
                              platform="cpu")
  assert f32["cpu_float32_copies"] == 0


@pytest.mark.parametrize("kind,platform", [("cpu", "cpu"), ("H200", "gpu"), ("TPU v5p", "tpu")])
def test_the_plan_models_the_step_on_its_device_kind(kind, platform):
  """--mode=plan runs on a laptop for an H200 job: the Gated DeltaNet chunk, the attention
  implementation and XLA:CPU's copies are those of plan.device_kind, not of this machine."""
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.plan.device_kind = kind
    c.model.dtype = c.model.param_dtype = "bfloat16"
  p = plan.memory_plan(c, 1, [2048])
  mc = qwen3_5.config_from_dict(c.model)
  rows = p["rows_per_device"]
  assert p["platform"] == platform
  assert p["activations"][0][1] == plan.activation_bytes(mc, 2048, rows, 1, 1, platform)
  assert (p["activations"][0][1]["cpu_float32_copies"] > 0) == (platform == "cpu")


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
