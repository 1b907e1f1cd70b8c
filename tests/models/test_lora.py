"""Low-rank adapters: the adapted model at init, against the explicit merged weights, their
sharding, which leaves they adapt and what the gradient reaches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import base
from models import lora
from models import qwen3_5
from models import sharding


def _spec(rank=4, alpha=8.0, targets=None):
  c = base.get_config()
  c.lora.rank, c.lora.alpha = rank, alpha
  if targets is not None:
    c.lora.targets = targets
  return lora.from_config(c.lora)


@pytest.fixture(scope="module")
def model():
  cfg = qwen3_5.config_from_dict(base.get_model_config())
  params = jax.jit(qwen3_5.init_params, static_argnums=0)(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
  return cfg, params, tokens


def _adapted_logits(jit, cfg, params, adapters, tokens, scale):
  return jit(lambda p, a, t: qwen3_5.forward(cfg, lora.attach(p, a, scale), t))(
      params, adapters, tokens)


def _random_b(adapters, seed=3):
  """Adapters with B drawn at random (at init B is zero and A @ B vanishes)."""
  leaves, tree = jax.tree_util.tree_flatten_with_path(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = [0.05 * jax.random.normal(k, x.shape) if p[-1].key == "b" else x
         for (p, x), k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(tree, out)


def test_lora_off_by_default_and_rank_zero_is_off():
  assert base.get_config().lora.rank == 0
  assert lora.from_config(base.get_config().lora) is None


def test_adapted_model_equals_the_base_bit_for_bit_at_init(model, default_emitters_jit):
  cfg, params, tokens = model
  spec = _spec()
  adapters = lora.init(spec, qwen3_5.param_axes(cfg), params, jax.random.key(2))
  assert all(float(jnp.abs(x).max()) == 0.0
             for p, x in jax.tree_util.tree_leaves_with_path(adapters) if p[-1].key == "b")
  assert any(float(jnp.abs(x).max()) > 0.0
             for p, x in jax.tree_util.tree_leaves_with_path(adapters) if p[-1].key == "a")
  jit = default_emitters_jit   # two programs compared bit for bit
  base_logits = jit(lambda p, t: qwen3_5.forward(cfg, p, t))(params, tokens)
  got = _adapted_logits(jit, cfg, params, adapters, tokens, spec.scale)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(base_logits))


def _explicit_merge(params, adapters, scale):
  """W + scale * A @ B by numpy reshapes, leaf by leaf: the input axes of A and the output axes
  of B flattened to one matrix product per batch index (independent of lora.delta)."""
  params = jax.tree.map(np.asarray, params)
  for j, block in enumerate(adapters["blocks"]):
    for group, leaves in block.items():
      for name, pair in leaves.items():
        w = params["blocks"][j][group][name]
        a, b = np.asarray(pair["a"], np.float64), np.asarray(pair["b"], np.float64)
        n_in = lora.INPUT_AXES[name]
        lead = a.ndim - n_in - 1
        batch = a.shape[:lead]
        a2 = a.reshape((-1,) + (int(np.prod(a.shape[lead:-1])), a.shape[-1]))
        b2 = b.reshape((-1, b.shape[lead], int(np.prod(b.shape[lead + 1:]))))
        d = np.matmul(a2, b2).reshape(w.shape)
        assert d.shape[:lead] == batch
        params["blocks"][j][group][name] = (w.astype(np.float64) + scale * d).astype(w.dtype)
  return params


def test_lora_forward_equals_the_forward_of_the_explicitly_merged_weights(model,
                                                                         default_emitters_jit):
  cfg, params, tokens = model
  spec = _spec(rank=3, alpha=6.0)
  adapters = _random_b(lora.init(spec, qwen3_5.param_axes(cfg), params, jax.random.key(2)))
  jit = default_emitters_jit   # `got` is compared bit for bit below
  got = np.asarray(_adapted_logits(jit, cfg, params, adapters, tokens, spec.scale))
  merged = _explicit_merge(params, adapters, spec.scale)
  want = np.asarray(jax.jit(lambda p, t: qwen3_5.forward(cfg, p, t))(merged, tokens))
  base_logits = np.asarray(jax.jit(lambda p, t: qwen3_5.forward(cfg, p, t))(params, tokens))
  assert np.abs(want - base_logits).max() > 1e-2          # the adapters change the model
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # lora.merge (the engine's and the merged export's) is the layer scan's merge.
  whole = jit(lambda p, a: lora.merge(p, a, spec.scale))(params, adapters)
  np.testing.assert_array_equal(
      np.asarray(jit(lambda p, t: qwen3_5.forward(cfg, p, t))(whole, tokens)), got)


def test_targets_adapt_attention_gdn_shared_and_routed_experts_but_not_the_router(model):
  cfg, _, _ = model
  paths = lora.adapted_paths(_spec(), qwen3_5.param_axes(cfg))
  names = {p.split("/", 2)[2] for p in paths}
  assert {"mixer/q_proj", "mixer/o_proj", "mixer/in_proj_qkv", "mixer/out_proj",
          "ffn/shared_up_proj", "ffn/wi_gate", "ffn/wo"} <= names
  assert "ffn/router" not in names
  with_router = lora.adapted_paths(_spec(targets=(r"ffn/router$",)), qwen3_5.param_axes(cfg))
  assert {p.split("/", 2)[2] for p in with_router} == {"ffn/router"}


def test_a_target_that_matches_no_projection_is_an_error(model):
  cfg, _, _ = model
  with pytest.raises(ValueError, match="matches no projection"):
    lora.adapted_paths(_spec(targets=(r"mixer/q_norm$",)), qwen3_5.param_axes(cfg))
  with pytest.raises(ValueError, match="lora.rank"):
    _spec(rank=-1)


def test_routed_expert_adapters_are_stacked_per_expert_and_sharded_like_the_experts(model):
  cfg, params, _ = model
  spec = _spec()
  adapters = jax.eval_shape(lambda: lora.init(spec, qwen3_5.param_axes(cfg), params,
                                              jax.random.key(0)))
  wi = adapters["blocks"][0]["ffn"]["wi_gate"]
  e = cfg.num_experts
  assert wi["a"].shape == (cfg.num_cycles, e, cfg.hidden_size, spec.rank)
  assert wi["b"].shape == (cfg.num_cycles, e, spec.rank, cfg.moe_intermediate_size)
  c = base.get_config()
  c.mesh.shape = (1, 2, 2, 2)
  mesh = sharding.make_mesh(c.mesh)
  rules = sharding.rules_from_config(c.mesh.rules)
  sh = sharding.tree_shardings(lora.axes(spec, qwen3_5.param_axes(cfg)), adapters, mesh, rules)
  base_sh = sharding.tree_shardings(qwen3_5.param_axes(cfg), params, mesh, rules)
  ffn = sh["blocks"][0]["ffn"]
  assert base_sh["blocks"][0]["ffn"]["wi_gate"].spec == P(None, "expert", "fsdp", "tensor")
  assert ffn["wi_gate"]["a"].spec == P(None, "expert", "fsdp", None)
  assert ffn["wi_gate"]["b"].spec == P(None, "expert", None, "tensor")
  assert ffn["wo"]["b"].spec == P(None, "expert", None, "fsdp")
  assert sh["blocks"][3]["mixer"]["q_proj"]["b"].spec == P(None, None, "tensor", None)


def test_gradient_reaches_every_adapter_through_the_merge(model):
  cfg, params, tokens = model
  spec = _spec()
  adapters = _random_b(lora.init(spec, qwen3_5.param_axes(cfg), params, jax.random.key(2)))
  loss = lambda a: jnp.mean(qwen3_5.forward(cfg, lora.attach(params, a, spec.scale), tokens)[..., 0])
  grads = jax.jit(jax.grad(loss))(adapters)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert float(jnp.abs(g).max()) > 0, jax.tree_util.keystr(path)


def test_the_router_adapter_maps_embed_to_experts_one_pair_per_layer(model):
  cfg, params, _ = model
  spec = _spec(targets=(r"ffn/router$",))
  adapters = lora.init(spec, qwen3_5.param_axes(cfg), params, jax.random.key(0))
  router = adapters["blocks"][0]["ffn"]["router"]
  assert router["a"].shape == (cfg.num_cycles, cfg.hidden_size, spec.rank)
  assert router["b"].shape == (cfg.num_cycles, spec.rank, cfg.num_experts)


def test_the_default_targets_adapt_a_dense_model_and_one_without_a_shared_expert():
  for kw in ({"use_moe": False}, {"shared_expert_intermediate_size": 0}):
    m = base.get_model_config()
    m.update(kw)
    cfg = qwen3_5.config_from_dict(m)
    names = {p.split("/", 2)[2] for p in lora.adapted_paths(_spec(), qwen3_5.param_axes(cfg))}
    assert "mixer/q_proj" in names
    assert ({"ffn/gate_proj", "ffn/down_proj"} if kw.get("use_moe") is False
            else {"ffn/wi_gate", "ffn/wo"}) <= names
