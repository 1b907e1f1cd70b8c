"""Low-rank adapters (LoRA) over the Qwen3.5 parameter tree.

An adapted weight is W + (alpha / r) A @ B, with A [..., in, r] and B [..., r, out]: `in` the
axes the layer contracts its input with (one axis; attention's o_proj two: heads, head_dim),
`out` the rest. Leading axes are batch axes: the layer cycle of `params["blocks"]` and, for the
routed experts, the expert axis, so each expert has its own pair, stored stacked [E, ...] and
sharded over the `expert` mesh axis like the experts (`axes`).

The adapters are a tree of their own that mirrors the base's paths:

    adapters = {"blocks": tuple over cycle positions of
                  {"mixer": {"q_proj": {"a": [cycles, embed, r], "b": [cycles, r, heads, 2 hd]}, ...},
                   "ffn":   {"wi_gate": {"a": [cycles, E, embed, r], "b": [cycles, E, r, mlp]}, ...}}}

How the model uses them: `attach(params, adapters, scale)` adds them to the params under "lora",
and the layer scan (models/qwen3_5.py, `_run_layers`) merges one layer's adapted weights at a
time (`merge_block`) before running it. Why merge per layer rather than adding x @ A @ B to each
projection's output: the layers stay as they are (the MoE's blocked and ragged dispatch, the
Gated DeltaNet's fused projections, attention's head layouts would each need a second,
per-expert low-rank path), only one layer's merged weights exist at a time, and the merge costs
r / tokens of the layer's matmuls (r = 8 against thousands of tokens a micro-batch). The price:
the backward pass forms each adapted weight's full gradient, layer by layer, before projecting it
onto A and B (the weight-gradient matmuls full fine-tuning does too; a low-rank path would skip
them), and with `model.remat = "none"` the backward pass keeps each layer's merged weights (one
more copy of the adapted weights, in the base's dtype and sharding); with `remat = "full"` it
merges them again instead (docs/lora.md has the measurements).

B starts at zero, so an adapted model's outputs equal the base's to the bit at init.
"""
from __future__ import annotations

import dataclasses
import math
import re
import string
from typing import Optional

import jax
import jax.numpy as jnp


# Leaves that can carry an adapter: name -> how many axes (after the batch axes) are its input.
# Everything else (norms, the conv kernel, the GDN's per-head biases, the shared expert's gate
# vector, the embedding and the LM head) cannot.
INPUT_AXES = {
    "q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2,                       # attention
    "in_proj_qkv": 1, "in_proj_z": 1, "in_proj_b": 1, "in_proj_a": 1, "out_proj": 1,  # GDN
    "router": 1, "wi_gate": 1, "wi_up": 1, "wo": 1,                           # routed experts
    "shared_gate_proj": 1, "shared_up_proj": 1, "shared_down_proj": 1,        # shared expert
    "gate_proj": 1, "up_proj": 1, "down_proj": 1,                             # dense MLP
}
# Logical axes that are batch axes of an adapter: one pair per layer, and per routed expert.
BATCH_AXES = ("layers", "experts")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """Rank r, alpha (the update is alpha / r A @ B) and the target regexes (re.search over
  paths like 'blocks/0/mixer/q_proj')."""
  rank: int
  alpha: float
  targets: tuple[str, ...]

  @property
  def scale(self) -> float:
    return float(self.alpha) / self.rank


def from_config(lora_cfg) -> Optional[LoraSpec]:
  """The `config.lora` section -> a LoraSpec, or None when lora.rank is 0 (off)."""
  rank = int(lora_cfg.rank)
  if rank < 0:
    raise ValueError(f"lora.rank must be >= 0 (0 = off), got {rank}")
  if rank == 0:
    return None
  if not float(lora_cfg.alpha) > 0:
    raise ValueError(f"lora.alpha must be > 0, got {lora_cfg.alpha}")
  targets = tuple(lora_cfg.targets)
  if not targets:
    raise ValueError("lora.targets is empty: name the projections to adapt")
  for t in targets:
    try:
      re.compile(t)
    except re.error as e:
      raise ValueError(f"lora.targets entry {t!r} is not a regular expression: {e}") from None
  return LoraSpec(rank, float(lora_cfg.alpha), targets)


def _path_str(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _leaf_name(path) -> str:
  return str(getattr(path[-1], "key", path[-1]))


def adapted_paths(spec: LoraSpec, param_axes: dict) -> list[str]:
  """Paths ('blocks/0/mixer/q_proj') of the leaves the targets adapt; a target that matches no
  leaf that can carry an adapter is an error (a typo would otherwise train nothing)."""
  leaves = jax.tree_util.tree_flatten_with_path(
      param_axes["blocks"], is_leaf=lambda a: isinstance(a, tuple) and all(
          isinstance(e, str) for e in a))[0]
  eligible = [f"blocks/{_path_str(p)}" for p, _ in leaves if _leaf_name(p) in INPUT_AXES]
  for t in spec.targets:
    if not any(re.search(t, name) for name in eligible):
      raise ValueError(f"lora.targets entry {t!r} matches no projection; they are named like "
                       f"{eligible[:3]} ... {eligible[-1:]}")
  return [name for name in eligible if any(re.search(t, name) for t in spec.targets)]


def _lead(axes: tuple) -> int:
  """How many leading axes are batch axes (the router's trailing `experts` axis is its output)."""
  n = 0
  while n < len(axes) and axes[n] in BATCH_AXES:
    n += 1
  return n


def _pair_axes(name: str, axes: tuple) -> dict:
  """Logical axes of the (a, b) pair of a leaf with logical `axes`."""
  lead = _lead(axes)
  n_in = INPUT_AXES[name]
  batch, inp, out = axes[:lead], axes[lead:lead + n_in], axes[lead + n_in:]
  return {"a": batch + inp + (None,), "b": batch + (None,) + out}


def _nest(flat: dict, n_blocks: int) -> dict:
  """{'blocks/j/x/y': v} -> {"blocks": tuple over j of {"x": {"y": v}}}."""
  blocks = [{} for _ in range(n_blocks)]
  for name, v in flat.items():
    parts = name.split("/")
    node = blocks[int(parts[1])]
    for k in parts[2:-1]:
      node = node.setdefault(k, {})
    node[parts[-1]] = v
  return {"blocks": tuple(blocks)}


def _flat_axes(param_axes: dict) -> dict:
  leaves = jax.tree_util.tree_flatten_with_path(
      param_axes, is_leaf=lambda a: isinstance(a, tuple) and all(
          isinstance(e, str) or e is None for e in a))[0]
  return {_path_str(p): a for p, a in leaves}


def axes(spec: LoraSpec, param_axes: dict) -> dict:
  """Logical axes of the adapters, from the base's (`qwen3_5.param_axes`): batch and input axes
  of A and the output axes of B as the weight's, the rank axis unsharded."""
  flat = _flat_axes(param_axes)
  return _nest({n: _pair_axes(n.rsplit("/", 1)[1], flat[n])
                for n in adapted_paths(spec, param_axes)}, len(param_axes["blocks"]))


def init(spec: LoraSpec, param_axes: dict, param_shapes: dict, key) -> dict:
  """Adapters (float32) for `spec` over a base with these axes and shapes (ShapeDtypeStructs or
  arrays). A ~ uniform(+-1/sqrt(fan_in)), B = 0: the adapted model starts as the base."""
  flat_axes, flat_shapes = _flat_axes(param_axes), {
      _path_str(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(param_shapes)[0]}
  out = {}
  for i, name in enumerate(adapted_paths(spec, param_axes)):
    shape, ax = flat_shapes[name], flat_axes[name]
    lead = _lead(ax)
    n_in = INPUT_AXES[name.rsplit("/", 1)[1]]
    inp, outs = shape[lead:lead + n_in], shape[lead + n_in:]
    bound = 1.0 / math.sqrt(math.prod(inp))
    a = jax.random.uniform(jax.random.fold_in(key, i), shape[:lead + n_in] + (spec.rank,),
                           jnp.float32, -bound, bound)
    out[name] = {"a": a, "b": jnp.zeros(shape[:lead] + (spec.rank,) + outs, jnp.float32)}
  return _nest(out, len(param_axes["blocks"]))


def delta(a, b, n_in: int) -> jax.Array:
  """A @ B over the rank axis, batch axes kept: a [*batch, *in, r], b [*batch, r, *out] ->
  [*batch, *in, *out] float32."""
  n_batch = a.ndim - n_in - 1
  letters = iter(string.ascii_letters)
  batch = "".join(next(letters) for _ in range(n_batch))
  inp = "".join(next(letters) for _ in range(n_in))
  out = "".join(next(letters) for _ in range(b.ndim - n_batch - 1))
  r = next(letters)
  return jnp.einsum(f"{batch}{inp}{r},{batch}{r}{out}->{batch}{inp}{out}",
                    a.astype(jnp.float32), b.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)


def merge_weight(w, pair: dict, scale: float, name: str) -> jax.Array:
  """w + scale * A @ B, summed in float32 and stored in w's dtype."""
  d = delta(pair["a"], pair["b"], INPUT_AXES[name])
  return (w.astype(jnp.float32) + scale * d).astype(w.dtype)


def merge_block(block: dict, block_adapters: dict, scale: float):
  """`block` (nested dicts of arrays, any leading axes) with each leaf that has an adapter in
  `block_adapters` (the same nesting, {"a", "b"} pairs) merged."""
  out = dict(block)
  for k, v in block_adapters.items():
    if isinstance(v, dict) and set(v) == {"a", "b"} and not isinstance(block[k], dict):
      out[k] = merge_weight(block[k], v, scale, k)
    else:
      out[k] = merge_block(block[k], v, scale)
  return out


def merge(params: dict, adapters: dict, scale: float) -> dict:
  """The whole base with every adapter merged (a plain parameter tree: the rollout engine's
  served weights, the merged export)."""
  blocks = tuple(merge_block(p, a, scale) for p, a in zip(params["blocks"], adapters["blocks"]))
  return dict(params, blocks=blocks)


def attach(params: dict, adapters: dict, scale: float) -> dict:
  """The base with adapters the layer scan merges layer by layer (models/qwen3_5.py). Build it
  inside the traced function, so `scale` stays a Python float."""
  return dict(params, lora={"blocks": adapters["blocks"], "scale": float(scale)})


def byte_count(tree) -> int:
  """Bytes of the arrays of `tree` (what a weight sync of it moves)."""
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
