"""The static description of a Qwen3.5 text model.

`ModelConfig` is a frozen dataclass so it can be a static argument of `jax.jit`. It is made
from the `config.model` section of an ml_collections config (`from_config_dict`) or from a
Hugging Face `config.json` (`from_hf_dict`), and written back by `to_hf_text_dict`.
"""
import contextlib
import dataclasses
import threading
from typing import Any, Mapping

import jax
import jax.numpy as jnp

LINEAR = "linear_attention"
FULL = "full_attention"


# The values of ModelConfig.attention_impl and .moe_dispatch (models/layers/attention.py and
# models/layers/moe.py say what each does).
ATTENTION_IMPLS = ("auto", "reference", "xla", "cudnn", "pallas")
MOE_DISPATCHES = ("auto", "ragged_dot", "blocked", "blocked_fused", "gmm")
# The values of ModelConfig.gdn_precision: the precision of the chunked delta rule's float32
# matmuls (jax.lax.Precision names; models/layers/gated_deltanet.py).
GDN_PRECISIONS = ("highest", "high", "default")
# The values of ModelConfig.gdn_scan: what the chunked delta rule's scan over chunks computes
# (models/layers/gated_deltanet.py, `chunked_delta_rule`).
GDN_SCANS = ("outputs", "states", "fused")
# The values of ModelConfig.gdn_storage_dtype: what `gdn_scan=fused`'s kernels store their
# tensors in between them (models/layers/gdn_fused.py); they compute in float32 either way.
GDN_STORAGE_DTYPES = ("float32", "bfloat16")
# The values of ModelConfig.decode_attention: how a decode step attends to the KV cache
# (models/layers/attention.py `decode`; models/layers/decode_fused.py).
DECODE_ATTENTIONS = ("xla", "fused")
# The values of ModelConfig.gdn_decode: how a decode step updates each Gated DeltaNet state
# (models/layers/gated_deltanet.py `recurrent_delta_rule`; models/layers/gdn_fused.py).
GDN_DECODES = ("xla", "fused")
# The values of ModelConfig.moe_expert_parallel (models/layers/moe.py, `expert_parallel`).
MOE_EXPERT_PARALLEL = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  hidden_size: int
  num_hidden_layers: int
  layer_types: tuple[str, ...]
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  partial_rotary_factor: float
  rope_theta: float
  linear_num_key_heads: int
  linear_num_value_heads: int
  linear_key_head_dim: int
  linear_value_head_dim: int
  linear_conv_kernel_dim: int
  gdn_chunk_size: int
  use_moe: bool
  intermediate_size: int
  num_experts: int
  num_experts_per_tok: int
  norm_topk_prob: bool
  moe_intermediate_size: int
  shared_expert_intermediate_size: int
  rms_norm_eps: float
  tie_word_embeddings: bool
  max_position_embeddings: int
  param_dtype: str
  dtype: str
  initializer_range: float
  scan_layers: bool
  remat: str
  attention_query_chunk: int = 0
  attention_causal_block: int = -1
  logits_chunk: int = 0
  gdn_backward: str = "custom"
  scan_unroll: int = -1
  attention_impl: str = "auto"
  moe_dispatch: str = "auto"
  moe_block_size: int = 128
  moe_block_chunk: int = -1
  gdn_precision: str = "highest"
  gdn_scan: str = "outputs"
  gdn_storage_dtype: str = "float32"
  gdn_recompute: bool = True
  decode_attention: str = "xla"
  gdn_decode: str = "xla"
  moe_expert_parallel: str = "auto"

  def __post_init__(self):
    if len(self.layer_types) != self.num_hidden_layers:
      raise ValueError(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                       f"{self.num_hidden_layers}")
    bad = set(self.layer_types) - {LINEAR, FULL}
    if bad:
      raise ValueError(f"unknown layer types {sorted(bad)}; expected {LINEAR!r} or {FULL!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if self.linear_num_value_heads % self.linear_num_key_heads:
      raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if self.use_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
      raise ValueError("num_experts_per_tok must be in [1, num_experts]")
    if self.moe_dispatch not in MOE_DISPATCHES:
      raise ValueError(f"moe_dispatch must be one of {MOE_DISPATCHES}, got {self.moe_dispatch!r}")
    if self.moe_block_size < 1:
      raise ValueError(f"moe_block_size must be >= 1, got {self.moe_block_size}")
    if self.moe_block_chunk < -1:
      raise ValueError(f"moe_block_chunk must be -1 (auto), 0 (all) or > 0, got "
                       f"{self.moe_block_chunk}")
    if self.remat not in ("none", "full"):
      raise ValueError(f"remat must be 'none' or 'full', got {self.remat!r}")
    if self.gdn_backward not in ("custom", "autodiff"):
      raise ValueError(f"gdn_backward must be 'custom' or 'autodiff', got {self.gdn_backward!r}")
    if self.gdn_precision not in GDN_PRECISIONS:
      raise ValueError(f"gdn_precision must be one of {GDN_PRECISIONS}, got "
                       f"{self.gdn_precision!r}")
    if self.gdn_scan not in GDN_SCANS:
      raise ValueError(f"gdn_scan must be one of {GDN_SCANS}, got {self.gdn_scan!r}")
    if self.gdn_storage_dtype not in GDN_STORAGE_DTYPES:
      raise ValueError(f"gdn_storage_dtype must be one of {GDN_STORAGE_DTYPES}, got "
                       f"{self.gdn_storage_dtype!r}")
    if self.gdn_storage_dtype != "float32" and self.gdn_scan != "fused":
      raise ValueError(f"gdn_storage_dtype={self.gdn_storage_dtype!r} is for gdn_scan='fused' "
                       f"(its kernels' stored tensors), got gdn_scan={self.gdn_scan!r}")
    if self.decode_attention not in DECODE_ATTENTIONS:
      raise ValueError(f"decode_attention must be one of {DECODE_ATTENTIONS}, got "
                       f"{self.decode_attention!r}")
    if self.gdn_decode not in GDN_DECODES:
      raise ValueError(f"gdn_decode must be one of {GDN_DECODES}, got {self.gdn_decode!r}")
    if self.moe_expert_parallel not in MOE_EXPERT_PARALLEL:
      raise ValueError(f"moe_expert_parallel must be one of {MOE_EXPERT_PARALLEL}, got "
                       f"{self.moe_expert_parallel!r}")
    if self.scan_unroll < -1:
      raise ValueError(f"scan_unroll must be >= -1 (-1 = auto, 0 = fully unrolled), got "
                       f"{self.scan_unroll}")
    if self.gdn_chunk_size == 0 or self.gdn_chunk_size < -1:
      raise ValueError(f"gdn_chunk_size must be >= 1 or -1 (auto), got {self.gdn_chunk_size}")
    if self.attention_causal_block < -1:
      raise ValueError(f"attention_causal_block must be >= -1 (-1 = auto, 0 = one block), got "
                       f"{self.attention_causal_block}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError("attention_impl must be 'auto', 'reference', 'xla', 'cudnn' or 'pallas', "
                       f"got {self.attention_impl!r}")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16", "float64"):
        raise ValueError(f"{name} must be float64, float32, bfloat16 or float16, got {getattr(self, name)!r}")

  # -- derived quantities -------------------------------------------------------------------
  @property
  def rotary_dim(self) -> int:
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def gdn_key_dim(self) -> int:
    return self.linear_num_key_heads * self.linear_key_head_dim

  @property
  def gdn_value_dim(self) -> int:
    return self.linear_num_value_heads * self.linear_value_head_dim

  @property
  def gdn_conv_dim(self) -> int:
    return 2 * self.gdn_key_dim + self.gdn_value_dim

  @property
  def cycle(self) -> tuple[str, ...]:
    """The shortest repeating pattern of `layer_types`; layers are scanned over its repeats."""
    n = self.num_hidden_layers
    if not self.scan_layers:
      return self.layer_types
    for period in range(1, n + 1):
      if n % period == 0 and self.layer_types == self.layer_types[:period] * (n // period):
        return self.layer_types[:period]
    return self.layer_types

  @property
  def num_cycles(self) -> int:
    return self.num_hidden_layers // len(self.cycle)

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)


def default_layer_types(num_layers: int, interval: int) -> tuple[str, ...]:
  return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


def from_config_dict(m: Mapping[str, Any]) -> ModelConfig:
  """From the `config.model` section, as resolved (`to_dict()`): its fields are the model.

  `preset` is only the record of the preset the fields default to (models/presets.py); it is
  not applied here, so a field set over the preset keeps the value set.
  """
  m = dict(m)
  m.pop("preset", None)
  interval = m.pop("full_attention_interval")
  layer_types = tuple(m.pop("layer_types") or ())
  if not layer_types:
    layer_types = default_layer_types(m["num_hidden_layers"], interval)
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = set(m) - fields
  if unknown:
    raise ValueError(f"unknown model config keys: {sorted(unknown)}")
  return ModelConfig(layer_types=layer_types, **m)


def from_hf_dict(d: Mapping[str, Any], *, dtype: str = "float32", **overrides) -> ModelConfig:
  """From a Hugging Face config.json dict, in either layout (nested `text_config` or flat)."""
  text = dict(d.get("text_config", d))
  rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
  rope_theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))
  partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
  n = text["num_hidden_layers"]
  layer_types = tuple(text.get("layer_types") or
                      default_layer_types(n, text.get("full_attention_interval", 4)))
  use_moe = "num_experts" in text and text.get("num_experts", 0) > 0
  tie = d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
  kw = dict(
      vocab_size=text["vocab_size"],
      hidden_size=text["hidden_size"],
      num_hidden_layers=n,
      layer_types=layer_types,
      num_attention_heads=text["num_attention_heads"],
      num_key_value_heads=text["num_key_value_heads"],
      head_dim=text.get("head_dim", text["hidden_size"] // text["num_attention_heads"]),
      partial_rotary_factor=float(partial),
      rope_theta=float(rope_theta),
      linear_num_key_heads=text["linear_num_key_heads"],
      linear_num_value_heads=text["linear_num_value_heads"],
      linear_key_head_dim=text["linear_key_head_dim"],
      linear_value_head_dim=text["linear_value_head_dim"],
      linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
      gdn_chunk_size=-1,
      use_moe=use_moe,
      intermediate_size=text.get("intermediate_size", 0) or 0,
      num_experts=text.get("num_experts", 0) if use_moe else 0,
      num_experts_per_tok=text.get("num_experts_per_tok", 0) if use_moe else 0,
      norm_topk_prob=True,
      moe_intermediate_size=text.get("moe_intermediate_size", 0) if use_moe else 0,
      shared_expert_intermediate_size=(text.get("shared_expert_intermediate_size", 0) or 0)
      if use_moe else 0,
      rms_norm_eps=text.get("rms_norm_eps", 1e-6),
      tie_word_embeddings=bool(tie),
      max_position_embeddings=text.get("max_position_embeddings", 262144),
      param_dtype=dtype,
      dtype=dtype,
      initializer_range=text.get("initializer_range", 0.02),
      scan_layers=True,
      remat="none",
      attention_query_chunk=0,
      attention_causal_block=-1,
      logits_chunk=0,
  )
  kw.update(overrides)
  return ModelConfig(**kw)


def to_hf_text_dict(cfg: ModelConfig) -> dict[str, Any]:
  """The `text_config` a Hugging Face Qwen3.5 model is built from."""
  d = dict(
      model_type="qwen3_5_moe_text" if cfg.use_moe else "qwen3_5_text",
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.hidden_size,
      num_hidden_layers=cfg.num_hidden_layers,
      layer_types=list(cfg.layer_types),
      num_attention_heads=cfg.num_attention_heads,
      num_key_value_heads=cfg.num_key_value_heads,
      head_dim=cfg.head_dim,
      hidden_act="silu",
      rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta,
                           partial_rotary_factor=cfg.partial_rotary_factor,
                           mrope_section=[11, 11, 10], mrope_interleaved=True),
      linear_num_key_heads=cfg.linear_num_key_heads,
      linear_num_value_heads=cfg.linear_num_value_heads,
      linear_key_head_dim=cfg.linear_key_head_dim,
      linear_value_head_dim=cfg.linear_value_head_dim,
      linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
      rms_norm_eps=cfg.rms_norm_eps,
      tie_word_embeddings=cfg.tie_word_embeddings,
      max_position_embeddings=cfg.max_position_embeddings,
      initializer_range=cfg.initializer_range,
      attention_bias=False,
  )
  if cfg.use_moe:
    d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
             moe_intermediate_size=cfg.moe_intermediate_size,
             shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
  else:
    d.update(intermediate_size=cfg.intermediate_size)
  return d

# The platform the model is traced for. Per-backend "auto" settings (the MoE dispatch, the
# Gated DeltaNet chunk, the attention implementation and causal blocks) follow it. It is JAX's
# default backend, except inside `compiling_for`: the compile mode traces on a CPU for TPU or
# GPU devices (rl/compile_job.py), and must choose what the run on those devices would.
_TARGET = threading.local()


@contextlib.contextmanager
def compiling_for(platform: str):
  """Within this context `platform()` is `platform` ("tpu", "gpu", "cpu")."""
  previous = getattr(_TARGET, "platform", None)
  _TARGET.platform = platform
  try:
    yield
  finally:
    _TARGET.platform = previous


def platform() -> str:
  """The platform the model is being traced for (see `compiling_for`)."""
  return getattr(_TARGET, "platform", None) or jax.default_backend()
