"""Feed-forward blocks: the sparse MoE with a shared expert, and the dense SwiGLU MLP.

MoE params (shapes with logical names):
  router         [embed, experts]             softmax -> top-k -> renormalise, in float32
  wi_gate, wi_up [experts, embed, expert_mlp]  routed SwiGLU experts
  wo             [experts, expert_mlp, embed]
  shared_gate_proj, shared_up_proj [embed, mlp]; shared_down_proj [mlp, embed]
  shared_expert_gate [embed]                  the shared expert is scaled by sigmoid(x . w)

Routing is dropless: the (token, expert) pairs are sorted by expert and each expert's rows
run as one group of `jax.lax.ragged_dot`, so no token is ever dropped for capacity.
"""
import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.layers import common


def init_mlp(key, hidden, inter, std, dt, prefix=""):
  kg, ku, kd = jax.random.split(key, 3)
  return {
      f"{prefix}gate_proj": common.normal(kg, (hidden, inter), std, dt),
      f"{prefix}up_proj": common.normal(ku, (hidden, inter), std, dt),
      f"{prefix}down_proj": common.normal(kd, (inter, hidden), std, dt),
  }


def mlp_axes(prefix=""):
  return {f"{prefix}gate_proj": ("embed", "mlp"), f"{prefix}up_proj": ("embed", "mlp"),
          f"{prefix}down_proj": ("mlp", "embed")}


def swiglu(p, x, dt, prefix=""):
  """Dense SwiGLU over x [..., embed]."""
  h = jax.nn.silu(common.dense(x, p[f"{prefix}gate_proj"], dt)) * common.dense(x, p[f"{prefix}up_proj"], dt)
  h = common.constrain(h, ("batch", "activation_length", "mlp")) if h.ndim == 3 else h
  return common.dense(h, p[f"{prefix}down_proj"], dt)


def init(key, cfg: ModelConfig) -> dict:
  h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  std, dt = cfg.initializer_range, cfg.jnp_param_dtype
  kr, kg, ku, kd, ks, ksg = jax.random.split(key, 6)
  p = {
      "router": common.normal(kr, (h, e), std, dt),
      "wi_gate": common.normal(kg, (e, h, i), std, dt),
      "wi_up": common.normal(ku, (e, h, i), std, dt),
      "wo": common.normal(kd, (e, i, h), std, dt),
  }
  if cfg.shared_expert_intermediate_size:
    p.update(init_mlp(ks, h, cfg.shared_expert_intermediate_size, std, dt, prefix="shared_"))
    p["shared_expert_gate"] = common.normal(ksg, (h,), std, dt)
  return p


def axes(cfg: ModelConfig) -> dict:
  a = {
      "router": ("embed", "experts"),
      "wi_gate": ("experts", "embed", "expert_mlp"),
      "wi_up": ("experts", "embed", "expert_mlp"),
      "wo": ("experts", "expert_mlp", "embed"),
  }
  if cfg.shared_expert_intermediate_size:
    a.update(mlp_axes(prefix="shared_"))
    a["shared_expert_gate"] = ("embed",)
  return a


def route(router_w, x, cfg: ModelConfig):
  """x [tokens, embed] -> (router logits [tokens, experts] f32, weights, expert ids [tokens, k])."""
  logits = jnp.dot(x.astype(jnp.float32), router_w.astype(jnp.float32))
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
  if cfg.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return logits, weights, experts


def routed_experts(p, x, weights, experts, cfg: ModelConfig):
  """Dropless expert computation. x [tokens, embed]; weights, experts [tokens, k]."""
  n, k = experts.shape
  dt = cfg.jnp_dtype
  flat_experts = experts.reshape(-1)
  order = jnp.argsort(flat_experts, stable=True)          # (token, slot) pairs grouped by expert
  token_of = order // k
  group_sizes = jnp.bincount(flat_experts, length=cfg.num_experts).astype(jnp.int32)
  xs = x[token_of].astype(dt)
  gate = jax.lax.ragged_dot(xs, p["wi_gate"].astype(dt), group_sizes)
  up = jax.lax.ragged_dot(xs, p["wi_up"].astype(dt), group_sizes)
  ys = jax.lax.ragged_dot(jax.nn.silu(gate) * up, p["wo"].astype(dt), group_sizes)
  ys = ys * weights.reshape(-1)[order][:, None].astype(dt)
  return jnp.zeros((n, x.shape[-1]), dt).at[token_of].add(ys)


def forward(p, x, cfg: ModelConfig):
  """Sparse MoE over x [batch, seq, embed]. Returns (out, router logits [b*s, experts] f32)."""
  b, s, h = x.shape
  dt = cfg.jnp_dtype
  flat = x.reshape(b * s, h).astype(dt)
  logits, weights, experts = route(p["router"], flat, cfg)
  out = routed_experts(p, flat, weights, experts, cfg)
  if cfg.shared_expert_intermediate_size:
    shared = swiglu(p, flat, dt, prefix="shared_")
    scale = jax.nn.sigmoid(common.dense(flat, p["shared_expert_gate"][:, None], dt))
    out = out + scale * shared
  return out.reshape(b, s, h), logits
