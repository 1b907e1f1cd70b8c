"""Named Qwen3.5 shapes. A preset fills the `config.model` fields it names; the rest keep
their defaults from configs/base.py (dtype, scan, remat, ...)."""

# Shared by both released MoE models.
_COMMON = dict(
    vocab_size=248320,
    head_dim=256,
    partial_rotary_factor=0.25,
    rope_theta=10_000_000.0,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    layer_types=(),
    use_moe=True,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=262144,
)

PRESETS = {
    "qwen3_5_35b_a3b": dict(
        _COMMON, num_hidden_layers=40, hidden_size=2048, num_attention_heads=16,
        num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512,
        linear_num_key_heads=16, linear_num_value_heads=32),
    "qwen3_5_397b_a17b": dict(
        _COMMON, num_hidden_layers=60, hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=2, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
        linear_num_key_heads=16, linear_num_value_heads=64),
}


def apply_preset(name: str, fields: dict) -> dict:
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  out = dict(fields)
  out.update(PRESETS[name])
  return out
