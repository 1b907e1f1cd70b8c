"""Named Qwen3.5 shapes: the defaults of the `config.model` fields a preset names.

A preset gives defaults, never values over the user's: configs/base.py links every field named
here to `config.model.preset` (configs/references.py), so a field reads its preset's value
until it is set -- in a config file, on the command line or by a sweep -- and a set field keeps
the value set. `--config.model.num_hidden_layers=4` on a preset config builds four layers;
`--config.model.preset=X` changes every field that was not set. Fields no preset names (dtypes,
scan, remat, ...) keep their configs/base.py defaults. Resolving `config.model` into a
ModelConfig (models/config.py) reads the fields only; `preset` is the record of the name.
"""

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


# Every field some preset names.
FIELDS = tuple(sorted({k for p in PRESETS.values() for k in p}))


def preset(name: str) -> dict:
  """The fields of preset `name` (a copy); a ValueError naming the known ones if there is none."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return dict(PRESETS[name])


def default(key: str, value, name: str):
  """What field `key` reads while it is not set: preset `name`'s value, or `value` (the field's
  own default) when `name` is "" or the preset does not name `key`."""
  return preset(name).get(key, value) if name else value
