"""Hugging Face checkpoint IO for Qwen3.5 text models (local directories only).

Two layouts are read:
  * hub (multimodal): config.json has `text_config`; weights under `model.language_model.`.
  * text-only, as `save_pretrained` of a `*ForCausalLM` writes: flat config; weights under `model.`.
Routed experts may be stored per expert (`mlp.experts.{e}.gate_proj.weight`, the hub's form)
or fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
`mtp.*` and `visual.*` tensors are ignored. `save` writes the hub layout with per-expert keys.

Every tensor is checked: a missing, unexpected or misshapen one raises `CheckpointError`
naming the key.
"""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.flax import save_file

from models import config as config_lib
from models.config import LINEAR, ModelConfig

_IGNORED = re.compile(r"^(mtp\.|model\.mtp\.|visual\.|model\.visual\.)")


class CheckpointError(ValueError):
  """A checkpoint directory that does not match the model it claims to hold."""


# Each entry: (hf key suffix, path inside the layer params, to_ours, to_hf, our shape fn).
# to_ours maps the HF array (torch layout [out, in]) to ours; to_hf is its inverse.

def _t(a):
  return a.T


def _layer_specs(cfg: ModelConfig, layer_type: str):
  h = cfg.hidden_size
  specs = [
      ("input_layernorm.weight", ("input_norm",), None, None),
      ("post_attention_layernorm.weight", ("post_norm",), None, None),
  ]
  if layer_type == LINEAR:
    la = "linear_attn."
    specs += [
        (la + "in_proj_qkv.weight", ("mixer", "in_proj_qkv"), _t, _t),
        (la + "in_proj_z.weight", ("mixer", "in_proj_z"), _t, _t),
        (la + "in_proj_b.weight", ("mixer", "in_proj_b"), _t, _t),
        (la + "in_proj_a.weight", ("mixer", "in_proj_a"), _t, _t),
        # torch Conv1d weight [channels, 1, kernel] <-> ours [kernel, channels]
        (la + "conv1d.weight", ("mixer", "conv"), lambda a: a[:, 0, :].T, lambda a: a.T[:, None, :]),
        (la + "dt_bias", ("mixer", "dt_bias"), None, None),
        (la + "A_log", ("mixer", "A_log"), None, None),
        (la + "norm.weight", ("mixer", "norm"), None, None),
        (la + "out_proj.weight", ("mixer", "out_proj"), _t, _t),
    ]
  else:
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    sa = "self_attn."
    specs += [
        (sa + "q_proj.weight", ("mixer", "q_proj"),
         lambda a: a.T.reshape(h, nh, 2 * hd), lambda a: a.reshape(h, nh * 2 * hd).T),
        (sa + "k_proj.weight", ("mixer", "k_proj"),
         lambda a: a.T.reshape(h, nkv, hd), lambda a: a.reshape(h, nkv * hd).T),
        (sa + "v_proj.weight", ("mixer", "v_proj"),
         lambda a: a.T.reshape(h, nkv, hd), lambda a: a.reshape(h, nkv * hd).T),
        (sa + "o_proj.weight", ("mixer", "o_proj"),
         lambda a: a.T.reshape(nh, hd, h), lambda a: a.reshape(nh * hd, h).T),
        (sa + "q_norm.weight", ("mixer", "q_norm"), None, None),
        (sa + "k_norm.weight", ("mixer", "k_norm"), None, None),
    ]
  if cfg.use_moe:
    specs.append(("mlp.gate.weight", ("ffn", "router"), _t, _t))
    if cfg.shared_expert_intermediate_size:
      for name in ("gate_proj", "up_proj", "down_proj"):
        specs.append((f"mlp.shared_expert.{name}.weight", ("ffn", f"shared_{name}"), _t, _t))
      specs.append(("mlp.shared_expert_gate.weight", ("ffn", "shared_expert_gate"),
                    lambda a: a[0], lambda a: a[None, :]))
  else:
    for name in ("gate_proj", "up_proj", "down_proj"):
      specs.append((f"mlp.{name}.weight", ("ffn", name), _t, _t))
  return specs


def _layer_index(cfg: ModelConfig, cycle_pos: int, cycle: int) -> int:
  return cycle * len(cfg.cycle) + cycle_pos


# -- reading ----------------------------------------------------------------------------------

class _TensorSource:
  """Lazily opens the safetensors files of a directory (single file or index + shards)."""

  def __init__(self, path: str):
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    elif os.path.exists(single):
      weight_map = {k: "model.safetensors" for k in self._open(single).keys()}
    else:
      raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    self.path = path
    self.weight_map = weight_map
    self._files = {}

  @staticmethod
  def _open(full: str):
    try:
      return safe_open(full, framework="flax")
    except Exception as e:  # truncated header, bad JSON, wrong magic
      raise CheckpointError(f"cannot open {full}: {e}") from e

  def keys(self):
    return self.weight_map.keys()

  def get(self, key: str) -> np.ndarray:
    fname = self.weight_map[key]
    if fname not in self._files:
      full = os.path.join(self.path, fname)
      if not os.path.exists(full):
        raise CheckpointError(f"shard {fname} (holding {key}) is missing from {self.path}")
      self._files[fname] = self._open(full)
    try:
      return np.asarray(self._files[fname].get_tensor(key).astype(jnp.float32))
    except Exception as e:  # a truncated or corrupt shard
      raise CheckpointError(f"cannot read tensor {key} from {fname}: {e}") from e


def _set_in(tree: dict, path: tuple, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def load(path: str, dtype=jnp.float32, **overrides):
  """Reads `path` -> (ModelConfig, params in `dtype`)."""
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise CheckpointError(f"{path}: no config.json")
  with open(cfg_path) as f:
    hf_config = json.load(f)
  dtype_name = jnp.dtype(dtype).name
  cfg = config_lib.from_hf_dict(hf_config, dtype=dtype_name, **overrides)
  src = _TensorSource(path)
  keys = [k for k in src.keys() if not _IGNORED.match(k)]
  prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in keys) \
      else "model."
  expected = _expected_shapes(cfg)   # our path -> our shape, to check every tensor
  used = set()

  def fetch(key, to_ours, our_path):
    if key not in src.weight_map:
      raise CheckpointError(f"missing tensor {key}")
    used.add(key)
    a = src.get(key)
    a = to_ours(a) if to_ours else a
    want = expected[our_path]
    if a.shape != want:
      raise CheckpointError(f"tensor {key} has shape {tuple(src.get(key).shape)}, "
                            f"which does not fit the config (expects {want} after conversion)")
    return a

  blocks = []
  for j, layer_type in enumerate(cfg.cycle):
    per_cycle = []
    for c in range(cfg.num_cycles):
      lp = f"{prefix}layers.{_layer_index(cfg, j, c)}."
      layer = {}
      for suffix, our, to_ours, _ in _layer_specs(cfg, layer_type):
        _set_in(layer, our, fetch(lp + suffix, to_ours, ("blocks", j) + our))
      if cfg.use_moe:
        layer["ffn"].update(_read_experts(cfg, src, lp + "mlp.experts.", used, expected, j))
      per_cycle.append(layer)
    blocks.append(jax.tree.map(lambda *xs: np.stack(xs), *per_cycle))
  params = {"embed": fetch(prefix + "embed_tokens.weight", None, ("embed",)),
            "blocks": tuple(blocks),
            "final_norm": fetch(prefix + "norm.weight", None, ("final_norm",))}
  if not cfg.tie_word_embeddings:
    params["lm_head"] = fetch("lm_head.weight", _t, ("lm_head",))
  extra = sorted(set(keys) - used - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
  if extra:
    raise CheckpointError(f"unexpected tensors in checkpoint: {extra[:5]}"
                          f"{' ...' if len(extra) > 5 else ''}")
  params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
  return cfg, params


def _read_experts(cfg, src, ep, used, expected, j):
  """Routed experts in our layout {wi_gate, wi_up [E, H, I], wo [E, I, H]}, either HF form."""
  e, i = cfg.num_experts, cfg.moe_intermediate_size
  if ep + "gate_up_proj" in src.weight_map:
    used.update({ep + "gate_up_proj", ep + "down_proj"})
    gate_up = src.get(ep + "gate_up_proj")
    if ep + "down_proj" not in src.weight_map:
      raise CheckpointError(f"missing tensor {ep}down_proj")
    down = src.get(ep + "down_proj")
    if gate_up.shape != (e, 2 * i, cfg.hidden_size):
      raise CheckpointError(f"tensor {ep}gate_up_proj has shape {gate_up.shape}, expected "
                            f"{(e, 2 * i, cfg.hidden_size)}")
    if down.shape != (e, cfg.hidden_size, i):
      raise CheckpointError(f"tensor {ep}down_proj has shape {down.shape}, expected "
                            f"{(e, cfg.hidden_size, i)}")
    gate_up = np.swapaxes(gate_up, 1, 2)
    return {"wi_gate": gate_up[..., :i], "wi_up": gate_up[..., i:], "wo": np.swapaxes(down, 1, 2)}
  out = {"wi_gate": [], "wi_up": [], "wo": []}
  for x in range(e):
    for name, ours, shape in (("gate_proj", "wi_gate", (i, cfg.hidden_size)),
                              ("up_proj", "wi_up", (i, cfg.hidden_size)),
                              ("down_proj", "wo", (cfg.hidden_size, i))):
      key = f"{ep}{x}.{name}.weight"
      if key not in src.weight_map:
        raise CheckpointError(f"missing tensor {key}")
      a = src.get(key)
      if a.shape != shape:
        raise CheckpointError(f"tensor {key} has shape {a.shape}, expected {shape}")
      used.add(key)
      out[ours].append(a.T)
  return {k: np.stack(v) for k, v in out.items()}


def _expected_shapes(cfg: ModelConfig) -> dict:
  """Our param path -> shape for one layer of each cycle position (no leading cycle axis)."""
  from models import qwen3_5  # pylint: disable=g-import-not-at-top
  shapes = jax.eval_shape(lambda k: qwen3_5.init_params(cfg, k), jax.random.key(0))
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    names = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)
    shape = leaf.shape[1:] if names[0] == "blocks" else leaf.shape
    out[names] = tuple(shape)
  return out


# -- writing ----------------------------------------------------------------------------------

def _get_in(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def to_hf_tensors(cfg: ModelConfig, params, prefix="model.language_model.") -> dict:
  """Our params -> {hf key: numpy array} in the hub layout with per-expert keys."""
  out = {prefix + "embed_tokens.weight": params["embed"], prefix + "norm.weight": params["final_norm"]}
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = params["lm_head"].T
  for j, layer_type in enumerate(cfg.cycle):
    block = params["blocks"][j]
    for c in range(cfg.num_cycles):
      lp = f"{prefix}layers.{_layer_index(cfg, j, c)}."
      for suffix, our, _, to_hf in _layer_specs(cfg, layer_type):
        a = _get_in(block, our)[c]
        out[lp + suffix] = to_hf(a) if to_hf else a
      if cfg.use_moe:
        ffn = block["ffn"]
        for x in range(cfg.num_experts):
          ep = f"{lp}mlp.experts.{x}."
          out[ep + "gate_proj.weight"] = ffn["wi_gate"][c, x].T
          out[ep + "up_proj.weight"] = ffn["wi_up"][c, x].T
          out[ep + "down_proj.weight"] = ffn["wo"][c, x].T
  return out


def save(cfg: ModelConfig, params, path: str, max_shard_bytes: int = 4 << 30):
  """Writes config.json + safetensors (sharded with an index past `max_shard_bytes`)."""
  os.makedirs(path, exist_ok=True)
  params = jax.device_get(params)
  tensors = {k: jnp.asarray(np.ascontiguousarray(v)) for k, v in to_hf_tensors(cfg, params).items()}
  text = config_lib.to_hf_text_dict(cfg)
  model_type = "qwen3_5_moe" if cfg.use_moe else "qwen3_5"
  hf_config = {
      "architectures": ["Qwen3_5MoeForConditionalGeneration" if cfg.use_moe
                        else "Qwen3_5ForConditionalGeneration"],
      "model_type": model_type,
      "text_config": text,
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "torch_dtype": jnp.dtype(cfg.param_dtype).name,
  }
  shards, current, size = [], {}, 0
  for k in sorted(tensors):
    nbytes = tensors[k].size * tensors[k].dtype.itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[k] = tensors[k]
    size += nbytes
  shards.append(current)
  # Write tensors first and the config last, so a directory with a config is complete.
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  else:
    weight_map = {}
    for n, shard in enumerate(shards):
      fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
      weight_map.update({k: fname for k in shard})
    total = sum(t.size * t.dtype.itemsize for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=1)
  return path
