"""Capacity planner: per-sequence decode state and the engine's slot count."""
import os

import pytest

from configs import base
from configs import qwen3_5_35b_a3b
from configs import qwen3_5_397b_a17b
from configs import tiny_cpu
from models import qwen3_5
from rl import plan as train_plan
from rl.learner import run_rl
from rl.run_files import run_dir
from rl.rollout import capacity


def _preset(name):
  m = base.get_model_config()
  m.preset = name
  return qwen3_5.config_from_dict(m)


def test_decode_state_of_the_35b_preset():
  cfg = _preset("qwen3_5_35b_a3b")
  kv, gdn = capacity.decode_state_bytes(cfg, 160_000, cache_bytes=2)
  assert kv == 10 * 2 * 2 * 256 * 160_000 * 2          # 10 attention layers of 40, 2 KV heads
  assert gdn == 30 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)  # conv + f32 recurrent state, any length
  # Past kv_heads, tensor parallelism stores whole heads on every rank.
  kv8, _ = capacity.decode_state_bytes(cfg, 160_000, cache_bytes=2, tensor_parallel=8)
  assert kv8 == 4 * kv


def test_report_layouts_are_tabulated():
  table = capacity.report_table()
  assert "35B-A3B" in table and "397B-A17B" in table and " 550 " in table and " 300 " in table


def test_engine_slots_from_the_planner():
  c = tiny_cpu.get_config()
  c.unlock()
  assert capacity.engine_slots(c) == c.rollout.slots  # an explicit slot count wins
  c.rollout.slots = 0                                  # 0 = ask the planner
  assert capacity.engine_slots(c) == c.rollout.max_slots  # a tiny model fits thousands
  c.rollout.capacity.device_memory_gib = 0.01
  p = capacity.plan_from_config(c)
  assert 0 < p.per_engine < c.rollout.max_slots
  assert capacity.engine_slots(c) == p.per_engine
  c.rollout.turn_cache = 5                             # kept turns take slots' room
  assert capacity.engine_slots(c) == p.per_engine - 5
  c.rollout.turn_cache = p.per_engine
  with pytest.raises(ValueError, match="turn_cache"):
    capacity.engine_slots(c)
  c.rollout.slots = 3
  assert capacity.engine_slots(c) == 3


def test_planner_counts_the_devices_of_the_engines_mesh_unless_told():
  c = tiny_cpu.get_config()
  c.unlock()
  c.rollout.slots = 0
  c.rollout.capacity.device_memory_gib = 0.01
  one = capacity.plan_from_config(c).per_engine          # tiny: rollout.mesh_shape (1, 1, 1, 1)
  c.rollout.mesh_shape = (1, 1, 1, 4)
  single = capacity.plan(qwen3_5.config_from_dict(c.model), context_len=c.rollout.max_len,
                         device_memory_gib=0.01, devices_per_engine=1,
                         memory_fraction=c.rollout.capacity.memory_fraction)
  assert abs(capacity.plan_from_config(c).engine_memory_bytes - 4 * single.engine_memory_bytes) <= 4
  assert capacity.plan_from_config(c).per_engine > one
  c.rollout.mesh_shape = ()                              # the trainer's (1, -1, 1, 1): all 8
  assert capacity.engine_mesh_shape(c, 8) == (1, 8, 1, 1)
  c.rollout.capacity.devices_per_engine = 2              # an explicit count wins
  assert capacity.plan_from_config(c).engine_memory_bytes < 8 * 0.01 * capacity.GIB


@pytest.mark.parametrize("module", [qwen3_5_35b_a3b, qwen3_5_397b_a17b])
def test_full_size_configs_serve_the_whole_context_in_bfloat16(module):
  """The recipe's engines hold a 160k episode per slot, one kept turn per in-flight episode
  beside the slots, weights at 2 bytes, on the devices the plan section names."""
  c = module.get_config()
  capacity.check_context(c)
  assert c.rollout.max_len == c.train.max_context == 160_000
  p = capacity.plan_from_config(c, c.plan.num_devices)
  cfg = qwen3_5.config_from_dict(c.model)
  # rollout.whole_weights (35B-A3B's): every device holds all but the routed experts and the
  # router's columns whole, and its `expert` axis's share of those (16 / 8 copies over the
  # devices); without it (397B-A17B's) each weight about once.
  assert dict(zip(c.mesh.axes, c.mesh.shape))["expert"] == 8
  if c.rollout.whole_weights:
    assert p.weight_bytes == 2 * _whole_weights_held(cfg, c.plan.num_devices, 8)
  else:
    total = qwen3_5.count_params(cfg)["total"]
    assert 2 * total <= p.weight_bytes < 2.002 * total
  assert p.engine_memory_bytes == int(c.plan.num_devices * 141 * capacity.GIB * 0.9)
  kept = c.train.prompts_per_step * c.train.samples_per_prompt
  assert c.rollout.turn_cache == kept
  assert p.per_engine >= kept + c.rollout.max_slots
  assert capacity.engine_slots(c, c.plan.num_devices) == c.rollout.max_slots
  assert tuple(c.rollout.stop_ids) == (248046, 248044)   # <|im_end|>, <|endoftext|>


def _whole_weights_held(cfg, devices: int, expert_ways: int) -> int:
  """Parameters an engine's `devices` hold together with rollout.whole_weights: the routed
  experts and the router split `expert_ways` ways, everything else on every device."""
  counts = qwen3_5.count_params(cfg)
  by_expert = counts["routed_experts"] + cfg.num_hidden_layers * cfg.hidden_size * cfg.num_experts
  return by_expert * devices // expert_ways + (counts["total"] - by_expert) * devices


def test_split_weights_are_held_once_and_whole_ones_once_a_device():
  """The planner's weights are the bytes the engine's layout holds: with rollout.whole_weights
  off (the trainer's FSDP rules) each weight about once over the engine's devices (vectors no
  rule splits are on every device), on: all but the routed experts on every device."""
  c = qwen3_5_35b_a3b.get_config()
  counts = qwen3_5.count_params(qwen3_5.config_from_dict(c.model))
  whole = capacity.held_params(c, qwen3_5.config_from_dict(c.model), 16)
  c.rollout.whole_weights = False
  split = capacity.held_params(c, qwen3_5.config_from_dict(c.model), 16)
  assert counts["total"] <= split < 1.001 * counts["total"]
  assert whole == _whole_weights_held(qwen3_5.config_from_dict(c.model), 16, 8)
  assert capacity.plan_from_config(c, 16).per_engine > 0


def test_a_planned_engine_size_counts_its_own_layout_not_this_machines():
  """rollout.capacity.devices_per_engine plans an engine this machine may not have: its weights
  are held as that engine's mesh lays them out (whole weights: on each of its devices), the
  same plan as on a machine of that many devices; an engine mesh of another size is an error."""
  c = qwen3_5_35b_a3b.get_config()
  c.rollout.mesh_shape = (1, 1, -1, 1)
  on_eight = capacity.plan_from_config(c, 8)
  c.rollout.capacity.devices_per_engine = 8
  planned = capacity.plan_from_config(c, 1)
  assert planned == on_eight
  assert planned.weight_bytes == 2 * _whole_weights_held(
      qwen3_5.config_from_dict(c.model), 8, 8)
  c.rollout.mesh_shape = (1, 1, 4, 1)
  with pytest.raises(ValueError, match="devices_per_engine=8 but the engine's mesh"):
    capacity.plan_from_config(c, 1)


def test_a_slot_shorter_than_the_context_is_refused_before_anything_runs():
  c = tiny_cpu.get_config()
  c.unlock()
  c.rollout.max_len = c.train.max_context - 1
  with pytest.raises(ValueError, match="rollout.max_len=2559 < train.max_context=2560"):
    capacity.check_context(c)
  c.name = "never_started"
  with pytest.raises(ValueError, match="rollout.max_len"):
    run_rl(c)
  assert not os.path.exists(run_dir(c))
  assert capacity.check_context(base.get_config()) is None   # the defaults agree


def test_device_memory_is_the_plan_sections_unless_told():
  c = tiny_cpu.get_config()
  c.unlock()
  c.plan.device_memory_gib = 2.0
  two = capacity.plan_from_config(c).engine_memory_bytes
  assert two == int(2.0 * capacity.GIB * c.rollout.capacity.memory_fraction)
  c.rollout.capacity.device_memory_gib = 1.0
  assert capacity.plan_from_config(c).engine_memory_bytes == two // 2


def test_an_engine_in_the_trainers_process_leaves_the_train_step_its_memory():
  c = tiny_cpu.get_config()
  c.unlock()
  train_bytes = lambda: train_plan.train_step_bytes_per_device(c, 8)
  assert capacity.sharing_devices(c, train_bytes) is c     # rollout.slots set: nothing planned
  c.rollout.slots = 0
  c.plan.device_memory_gib = 0.25
  shared = capacity.sharing_devices(c, train_bytes, num_devices=8)
  p = train_plan.memory_plan(c, 8, [c.train.seq_len])
  held = p["params"] + p["grads"] + p["opt"] + p["activations"][0][1]["total"]
  assert held > 0
  # The engine serves from one of the trainer's 8 devices (tiny: rollout.mesh_shape (1,1,1,1)).
  assert shared.rollout.capacity.reserve_gib * capacity.GIB == pytest.approx(held)
  alone, beside = (capacity.plan_from_config(x, 8) for x in (c, shared))
  assert alone.free_bytes - beside.free_bytes == pytest.approx(held, abs=1)
  assert beside.per_engine < alone.per_engine
  assert c.rollout.capacity.reserve_gib == 0.0               # the caller's config is untouched


def test_planner_slots_are_a_multiple_of_the_devices_that_split_them():
  """The decode state's slots are split over the engine mesh's `batch` axes; a count they do not
  divide would leave every slot whole on every device (35B-A3B's 49 planner slots compiled to
  160.6 GiB a GPU of generate arguments, against 27.1 planned). 35B-A3B on one host of 8: room
  for 305 sequences, 256 kept turns: 49 -> 48."""
  c = qwen3_5_35b_a3b.get_config()
  c.unlock()
  c.rollout.mesh_shape, c.rollout.max_slots = (1, 1, 8, 1), 1024
  c.rollout.whole_weights = False       # (the weights' split layout: the figures above)
  p = capacity.plan_from_config(c, 8)
  assert p.per_engine - c.rollout.turn_cache == 49
  assert capacity.engine_slots(c, 8) == 48
  c.rollout.mesh_shape = (1, 1, 4, 2)                 # `tensor` does not split the slots
  assert capacity.slots_the_mesh_splits(c, 49, 8) == 48
  assert capacity.slots_the_mesh_splits(c, 3, 8) == 3  # fewer slots than ways: kept as they are
