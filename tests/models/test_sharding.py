"""Meshes from config and logical-axis rules (8 fake CPU devices, see tests/conftest.py)."""
import jax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from configs import base
from models import qwen3_5
from models import sharding


def _mesh_cfg(shape):
  c = base.get_config()
  with c.mesh.unlocked():
    c.mesh.shape = shape
  return c


def test_resolve_shape():
  axes = ("data", "fsdp", "expert", "tensor")
  assert sharding.resolve_mesh_shape(axes, (1, -1, 1, 1), 8) == (1, 8, 1, 1)
  assert sharding.resolve_mesh_shape(axes, (2, 2, 2, 1), 8) == (2, 2, 2, 1)
  with pytest.raises(sharding.MeshError, match="needs 16 devices, but 8 are available"):
    sharding.resolve_mesh_shape(axes, (2, 2, 2, 2), 8)
  with pytest.raises(sharding.MeshError, match="not a multiple of 3"):
    sharding.resolve_mesh_shape(axes, (3, -1, 1, 1), 8)
  with pytest.raises(sharding.MeshError, match="more than one -1"):
    sharding.resolve_mesh_shape(axes, (-1, -1, 1, 1), 8)


def test_make_mesh_has_auto_axes():
  assert jax.device_count() == 8
  mesh = sharding.make_mesh(_mesh_cfg((2, 2, 2, 1)).mesh)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
  assert all(t == AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(sharding.MeshError):
    sharding.make_mesh(_mesh_cfg((4, 4, 1, 1)).mesh)


def test_param_shardings_follow_rules():
  c = _mesh_cfg((1, 2, 2, 2))
  mesh = sharding.make_mesh(c.mesh)
  rules = sharding.rules_from_config(c.mesh.rules)
  mc = qwen3_5.config_from_dict(c.model)
  shapes = jax.eval_shape(lambda k: qwen3_5.init_params(mc, k), jax.random.key(0))
  sh = sharding.tree_shardings(qwen3_5.param_axes(mc), shapes, mesh, rules)
  ffn = sh["blocks"][0]["ffn"]
  # Experts split over expert, their embed dimension FSDP over fsdp (the fallback rule).
  assert ffn["wi_gate"].spec == P(None, "expert", "fsdp", "tensor")
  assert ffn["wo"].spec == P(None, "expert", "tensor", "fsdp")
  # Other weights FSDP over fsdp x expert (no device holds a replica of them) + TP mlp.
  fsdp = ("fsdp", "expert")
  assert ffn["shared_gate_proj"].spec == P(None, fsdp, "tensor")
  assert sh["embed"].spec == P("tensor", fsdp)
  assert sh["lm_head"].spec == P(fsdp, "tensor")
  attn = sh["blocks"][3]["mixer"]
  assert attn["q_proj"].spec == P(None, fsdp, "tensor", None)           # heads over tensor
  assert sh["final_norm"].spec == P(None)


def test_non_divisible_dims_fall_back_to_replication():
  c = _mesh_cfg((1, 1, 1, 8))
  mesh = sharding.make_mesh(c.mesh)
  rules = sharding.rules_from_config(c.mesh.rules)
  # 2 kv heads cannot be split 8 ways: replicated; 1024 vocab can.
  assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), rules, mesh, (64, 2, 16)) == P(None, None, None)
  assert sharding.logical_to_spec(("vocab", "embed"), rules, mesh, (1024, 64)) == P("tensor", None)
  # The batch rule spans several axes; drops trailing axes until the size divides.
  c2 = _mesh_cfg((2, 2, 2, 1))
  mesh2 = sharding.make_mesh(c2.mesh)
  assert sharding.logical_to_spec(("batch", None), rules, mesh2, (8, 5)) == P(("data", "fsdp", "expert"), None)
  assert sharding.logical_to_spec(("batch", None), rules, mesh2, (4, 5)) == P(("data", "fsdp"), None)


def test_context_parallel_rules_split_rows_over_the_named_axes_and_batch_over_the_rest():
  rules = base.get_config().mesh.rules
  cp = dict(sharding.context_parallel_rules(rules, "fsdp"))
  assert cp["activation_length"] == "fsdp" and cp["batch"] == ("data", "expert")
  cp2 = dict(sharding.context_parallel_rules(rules, ("fsdp", "expert")))
  assert cp2["activation_length"] == ("fsdp", "expert") and cp2["batch"] == "data"
  # Everything else (the parameters' layout) is unchanged.
  moved = ("batch", "activation_length", "activation_heads", "activation_vocab")
  assert {k: v for k, v in cp.items() if k not in moved} == {
      k: v for k, v in dict(sharding.rules_from_config(rules)).items() if k not in moved}
  # And back to whole rows (the rollout engine's layout): the same axes, batch in a new order.
  rows = dict(sharding.without_context_parallel(sharding.context_parallel_rules(rules, ("fsdp", "expert"))))
  assert rows["activation_length"] is None and rows["batch"] == ("data", "fsdp", "expert")
  assert sharding.without_context_parallel(rules) == sharding.rules_from_config(rules)
  # The sequence mixers' heads and the LM head's vocabulary go over the split axes and the
  # tensor axis (and back).
  for name in ("activation_heads", "activation_vocab"):
    assert cp2[name] == ("fsdp", "expert", "tensor")
    assert rows[name] == "tensor"
