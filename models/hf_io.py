"""Hugging Face checkpoint IO for Qwen3.5 text models (local directories only).

Two layouts are read:
  * hub (multimodal): config.json has `text_config`; weights under `model.language_model.`.
  * text-only, as `save_pretrained` of a `*ForCausalLM` writes: flat config; weights under `model.`.
Routed experts may be stored per expert (`mlp.experts.{e}.gate_proj.weight`, the hub's form)
or fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
`mtp.*` and `visual.*` tensors are ignored. `load_sharded` builds each parameter on its devices
from the blocks they hold (for meshes whose model no single host could hold).

`save` writes the model side of a Hugging Face directory (docs/hf_export.md): the tensors under
`model.language_model.` with per-expert keys (what `save_pretrained` of a transformers
`Qwen3_5MoeForCausalLM` writes too) and a text-only config.json (`Qwen3_5MoeForCausalLM` /
`Qwen3_5ForCausalLM`). Its `extras` hook adds other files; envs.chat.hf_export.save_hf uses it
for the tokenizer side (tokenizer.json, tokenizer_config.json with the chat template,
generation_config.json), which this package does not depend on.

Every tensor is checked: a missing, unexpected or misshapen one raises `CheckpointError`
naming the key.

`load` and `load_sharded` take the model's `init_params` (models/qwen3_5.py passes its own from
`load_hf`) for the tree and shapes they fill: the model imports this module, not the reverse.
"""
import json
import os
import re
from typing import Callable, Optional

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


def layer_index(cfg: ModelConfig, cycle_pos: int, cycle: int) -> int:
  """The Hugging Face layer number of cycle `cycle` at cycle position `cycle_pos`."""
  return _layer_index(cfg, cycle_pos, cycle)


def module_names(cfg: ModelConfig, layer_type: str) -> dict:
  """Our path inside a layer's params (("mixer", "q_proj")) -> the transformers module or
  parameter holding that weight, relative to the layer ("self_attn.q_proj"), for each matrix
  stored as ours reshaped and transposed (torch [out, in] = ours [in..., out...] flattened,
  transposed). The routed experts are not among them (fused 3-D parameters there)."""
  return {our: suffix[:-len(".weight")] for suffix, our, to_ours, _ in _layer_specs(cfg, layer_type)
          if to_ours is not None and suffix.endswith(".weight") and "conv1d" not in suffix
          and "shared_expert_gate" not in suffix}


# -- reading ----------------------------------------------------------------------------------
#
# Reading is planned before any tensor is read: every parameter becomes a `_Leaf` (its global
# shape in our layout and a `read(index)` that returns just that block of it), built from the
# safetensors headers alone, which also checks every key and shape. `load` reads each leaf
# whole; `load_sharded` hands `read` to jax.make_array_from_callback, so each device gets only
# its own shard and the host never holds more than one shard of one tensor (plus, for the
# few tensors whose conversion is a reshape, one layer's tensor).

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

  def _file(self, key: str):
    if key not in self.weight_map:
      raise CheckpointError(f"missing tensor {key}")
    fname = self.weight_map[key]
    if fname not in self._files:
      full = os.path.join(self.path, fname)
      if not os.path.exists(full):
        raise CheckpointError(f"shard {fname} (holding {key}) is missing from {self.path}")
      self._files[fname] = self._open(full)
    return self._files[fname]

  def shape(self, key: str) -> tuple:
    """The stored shape of `key`, from the file header (no data is read)."""
    f = self._file(key)
    try:
      return tuple(f.get_slice(key).get_shape())
    except Exception as e:  # noqa: BLE001
      raise CheckpointError(f"cannot read the header of tensor {key}: {e}") from e

  def get(self, key: str, index: tuple | None = None) -> np.ndarray:
    """`key` (or just its block `index`, a tuple of slices in the stored layout) as float32."""
    f = self._file(key)
    try:
      a = f.get_tensor(key) if index is None else f.get_slice(key)[index]
      return np.asarray(a.astype(jnp.float32))
    except Exception as e:  # a truncated or corrupt shard
      raise CheckpointError(f"cannot read tensor {key} from {self.weight_map[key]}: {e}") from e


class _Leaf:
  """One parameter: its global shape in our layout and `read(index) -> that block`."""

  def __init__(self, shape: tuple, read):
    self.shape, self.read = tuple(shape), read

  def full_index(self) -> tuple:
    return tuple(slice(0, n) for n in self.shape)


def _full_slices(index, shape) -> tuple:
  """A jax shard index (slices, possibly fewer than dims, possibly open) -> closed slices."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  out = []
  for s, n in zip(index, shape):
    a, b, step = s.indices(n)
    if step != 1:
      raise ValueError(f"strided shard index {index}")
    out.append(slice(a, b))
  return tuple(out)


def _converted(src, key, to_ours, want):
  """A reader of one stored tensor in our layout: index (our layout) -> block.

  Stored as ours or as its transpose (most matrices), only the block is read; a reshaping
  conversion (attention projections, conv) reads the tensor and slices after converting.
  """
  stored = src.shape(key)
  if to_ours is None:
    got = stored
  elif to_ours is _t:
    got = stored[::-1]
  else:
    got = tuple(jax.eval_shape(to_ours, jax.ShapeDtypeStruct(stored, jnp.float32)).shape)
  if got != tuple(want):
    raise CheckpointError(f"tensor {key} has shape {stored}, which does not fit the config "
                          f"(expects {tuple(want)} after conversion)")
  if to_ours is None:
    return lambda idx: src.get(key, idx)
  if to_ours is _t:
    return lambda idx: src.get(key, idx[::-1]).T
  return lambda idx: np.asarray(to_ours(src.get(key)))[idx]


def _stacked(readers):
  """Per-layer readers -> the reader of their stack along a leading layer axis."""
  return lambda idx: np.stack([readers[c](idx[1:]) for c in range(idx[0].start, idx[0].stop)])


def _plan(cfg: ModelConfig, src: _TensorSource, expected: dict) -> dict:
  """Our param path -> `_Leaf`; checks every stored key's shape against `expected` (our path ->
  our shape, one layer for block params: `_expected_shapes`)."""
  keys = [k for k in src.keys() if not _IGNORED.match(k)]
  prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in keys) \
      else "model."
  used, plan = set(), {}

  def reader(key, to_ours, our_path):
    used.add(key)
    return _converted(src, key, to_ours, expected[our_path])

  for j, layer_type in enumerate(cfg.cycle):
    layers = [f"{prefix}layers.{_layer_index(cfg, j, c)}." for c in range(cfg.num_cycles)]
    for suffix, our, to_ours, _ in _layer_specs(cfg, layer_type):
      path = ("blocks", j) + our
      plan[path] = _Leaf((cfg.num_cycles,) + expected[path],
                         _stacked([reader(lp + suffix, to_ours, path) for lp in layers]))
    if cfg.use_moe:
      plan.update(_plan_experts(cfg, src, [lp + "mlp.experts." for lp in layers], used, j,
                                expected))
  plan[("embed",)] = _Leaf(expected[("embed",)],
                           reader(prefix + "embed_tokens.weight", None, ("embed",)))
  plan[("final_norm",)] = _Leaf(expected[("final_norm",)],
                                reader(prefix + "norm.weight", None, ("final_norm",)))
  if not cfg.tie_word_embeddings:
    plan[("lm_head",)] = _Leaf(expected[("lm_head",)], reader("lm_head.weight", _t, ("lm_head",)))
  extra = sorted(set(keys) - used - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
  if extra:
    raise CheckpointError(f"unexpected tensors in checkpoint: {extra[:5]}"
                          f"{' ...' if len(extra) > 5 else ''}")
  return plan


def _plan_experts(cfg, src, prefixes, used, j, expected) -> dict:
  """Routed experts {wi_gate, wi_up [L, E, H, I], wo [L, E, I, H]}, from either stored form.

  Only the experts (and rows/columns) of the requested block are read: an expert-parallel
  shard never touches the other experts' bytes.
  """
  e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
  per_layer = {"wi_gate": [], "wi_up": [], "wo": []}   # ours: [E, H, I], [E, H, I], [E, I, H]
  for ep in prefixes:
    if ep + "gate_up_proj" in src.weight_map:
      # Fused: gate_up_proj [E, 2I, H], down_proj [E, H, I].
      gu, down = ep + "gate_up_proj", ep + "down_proj"
      for key, want in ((gu, (e, 2 * i, h)), (down, (e, h, i))):
        if src.shape(key) != want:
          raise CheckpointError(f"tensor {key} has shape {src.shape(key)}, expected {want}")
      used.update({gu, down})

      def gate_or_up(idx, gu=gu, offset=0):   # idx over [E, H, I]
        rows = slice(idx[2].start + offset, idx[2].stop + offset)
        return np.swapaxes(src.get(gu, (idx[0], rows, idx[1])), 1, 2)
      per_layer["wi_gate"].append(gate_or_up)
      per_layer["wi_up"].append(lambda idx, f=gate_or_up: f(idx, offset=i))
      per_layer["wo"].append(
          lambda idx, down=down: np.swapaxes(src.get(down, (idx[0], idx[2], idx[1])), 1, 2))
    else:
      # Per expert, torch layout: gate_proj / up_proj [I, H], down_proj [H, I].
      for name, ours, stored in (("gate_proj", "wi_gate", (i, h)), ("up_proj", "wi_up", (i, h)),
                                 ("down_proj", "wo", (h, i))):
        keys = [f"{ep}{x}.{name}.weight" for x in range(e)]
        for key in keys:
          if src.shape(key) != stored:
            raise CheckpointError(f"tensor {key} has shape {src.shape(key)}, expected {stored}")
        used.update(keys)
        per_layer[ours].append(
            lambda idx, keys=keys: np.stack([src.get(keys[x], idx[1:][::-1]).T
                                             for x in range(idx[0].start, idx[0].stop)]))
  paths = {name: ("blocks", j, "ffn", name) for name in per_layer}
  return {paths[name]: _Leaf((cfg.num_cycles,) + expected[paths[name]], _stacked(readers))
          for name, readers in per_layer.items()}


def read_config(path: str, dtype=jnp.float32, **overrides) -> ModelConfig:
  """The ModelConfig of the checkpoint at `path` (config.json only)."""
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise CheckpointError(f"{path}: no config.json")
  with open(cfg_path) as f:
    hf_config = json.load(f)
  return config_lib.from_hf_dict(hf_config, dtype=jnp.dtype(dtype).name, **overrides)


def _open(path: str, init_params, dtype, overrides) -> tuple[ModelConfig, dict, object]:
  """(config, plan, abstract params) of the checkpoint at `path`; the params' tree and shapes
  are those `init_params(cfg, key)` builds."""
  cfg = read_config(path, dtype, **overrides)
  abstract = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
  return cfg, _plan(cfg, _TensorSource(path), _expected_shapes(abstract)), abstract


def _names(path) -> tuple:
  return tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)


def load(path: str, init_params, dtype=jnp.float32, **overrides):
  """Reads `path` -> (ModelConfig, params in `dtype`), each param whole on the default device.
  `init_params(cfg, key)`: the model's init (qwen3_5.init_params), which fixes the tree."""
  cfg, plan, abstract = _open(path, init_params, dtype, overrides)

  def one(p, _):
    leaf = plan[_names(p)]
    return jnp.asarray(leaf.read(leaf.full_index()), dtype)
  return cfg, jax.tree_util.tree_map_with_path(one, abstract)


def load_sharded(path: str, shardings, init_params, dtype=jnp.float32, **overrides):
  """Reads `path` -> (ModelConfig, params laid out by `shardings`).

  `shardings`: a jax.sharding.Sharding per param, in the structure of `init_params` (e.g.
  TrainStep.state_shardings["params"]). Each process reads only the blocks its own devices
  hold, one block at a time, so host memory stays at about one shard of one tensor instead of
  the whole model (which, for the full-size configs, no host has). `init_params` as in `load`.
  """
  cfg, plan, abstract = _open(path, init_params, dtype, overrides)

  def one(p, sds, sharding):
    leaf = plan[_names(p)]
    blocks = {}   # replicas of a shard on several local devices: read once

    def block(index):
      idx = _full_slices(index, leaf.shape)
      k = tuple((s.start, s.stop) for s in idx)
      if k not in blocks:
        blocks[k] = np.asarray(leaf.read(idx)).astype(sds.dtype)
      return blocks[k]
    return jax.make_array_from_callback(leaf.shape, sharding, block)
  return cfg, jax.tree_util.tree_map_with_path(one, abstract, shardings)


def _expected_shapes(abstract_params) -> dict:
  """Our param path -> shape for one layer of each cycle position (no leading cycle axis), from
  the abstract params (jax.eval_shape of init_params)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
    names = _names(path)
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


def text_config_dict(cfg: ModelConfig) -> dict:
  """config.json as `save` writes it: the text model's config, flat, naming the transformers
  class that builds exactly that model (no vision tower)."""
  return {
      "architectures": ["Qwen3_5MoeForCausalLM" if cfg.use_moe else "Qwen3_5ForCausalLM"],
      **config_lib.to_hf_text_dict(cfg),
      "dtype": jnp.dtype(cfg.param_dtype).name,
  }


def hub_config_dict(cfg: ModelConfig) -> dict:
  """config.json in the multimodal hub layout (the text config under `text_config`), as `save`
  wrote it before it wrote text-only configs; `load` reads both."""
  return {
      "architectures": ["Qwen3_5MoeForConditionalGeneration" if cfg.use_moe
                        else "Qwen3_5ForConditionalGeneration"],
      "model_type": "qwen3_5_moe" if cfg.use_moe else "qwen3_5",
      "text_config": config_lib.to_hf_text_dict(cfg),
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "torch_dtype": jnp.dtype(cfg.param_dtype).name,
  }


def canonical_config_bytes(path: str) -> bytes | None:
  """The model config of the checkpoint at `path` in one fixed form (hub_config_dict, as JSON
  with indent 1), whichever layout its config.json has; None when it holds no Qwen3.5 config.
  Two directories with the same model config give the same bytes."""
  try:
    cfg = read_config(path)
  except (CheckpointError, KeyError, TypeError, ValueError):
    return None
  return json.dumps(hub_config_dict(cfg), indent=1).encode()


def save(cfg: ModelConfig, params, path: str, max_shard_bytes: int = 4 << 30,
         extras: Optional[Callable[[str], None]] = None):
  """Writes a Hugging Face checkpoint directory (safetensors sharded with an index past
  `max_shard_bytes`, a text-only config.json).

  Args:
    cfg, params: the model.
    path: the directory.
    max_shard_bytes: the largest safetensors file.
    extras: called with `path` after the weights and before config.json, to add files (the
      tokenizer and generation defaults: envs.chat.hf_export.save_hf, which the model package
      does not depend on).
  """
  os.makedirs(path, exist_ok=True)
  params = jax.device_get(params)
  tensors = {k: jnp.asarray(np.ascontiguousarray(v)) for k, v in to_hf_tensors(cfg, params).items()}
  shards, current, size = [], {}, 0
  for k in sorted(tensors):
    nbytes = tensors[k].size * tensors[k].dtype.itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[k] = tensors[k]
    size += nbytes
  shards.append(current)
  # Write tensors and tokenizer first and the config last, so a directory with a config is
  # complete.
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
  if extras is not None:
    extras(path)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(text_config_dict(cfg), f, indent=1)
    f.write("\n")
  return path
