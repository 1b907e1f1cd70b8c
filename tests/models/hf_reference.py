"""Builds random Hugging Face Qwen3.5 models (the numerical reference) for the model tests."""
import torch
import transformers


def make_hf_model(*, moe: bool = True, seed: int = 0, **overrides):
  """A random tiny Qwen3_5MoeForCausalLM / Qwen3_5ForCausalLM with every weight randomised.

  HF initialises norms and the router at zero; a zero router makes top-k a tie, so every
  parameter is redrawn here (norm scales around their identity, A_log in the usual range).
  """
  base = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
              max_position_embeddings=512,
              rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0,
                                   partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                                   mrope_interleaved=True))
  if moe:
    base.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48)
  else:
    base.update(intermediate_size=96)
  base.update(overrides)
  torch.manual_seed(seed)
  if moe:
    cfg = transformers.Qwen3_5MoeTextConfig(**base)
    model = transformers.Qwen3_5MoeForCausalLM(cfg)
  else:
    cfg = transformers.Qwen3_5TextConfig(**base)
    model = transformers.Qwen3_5ForCausalLM(cfg)
  model.config._attn_implementation = "eager"  # pylint: disable=protected-access
  gen = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("A_log"):
        p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 15 + 1))
      elif name.endswith("linear_attn.norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
      elif "norm" in name or name.endswith("dt_bias"):
        p.copy_(0.1 * torch.randn(p.shape, generator=gen))
      else:
        p.copy_(0.05 * torch.randn(p.shape, generator=gen))
  model.eval()
  return model


def hf_grads_per_expert(model) -> dict:
  """Parameter gradients keyed like a text-only checkpoint, experts split per expert."""
  out = {}
  for name, p in model.named_parameters():
    g = p.grad.detach().numpy()
    if name.endswith("mlp.experts.gate_up_proj"):
      base = name[: -len("gate_up_proj")]
      inter = g.shape[1] // 2
      for e in range(g.shape[0]):
        out[f"{base}{e}.gate_proj.weight"] = g[e, :inter]
        out[f"{base}{e}.up_proj.weight"] = g[e, inter:]
    elif name.endswith("mlp.experts.down_proj"):
      base = name[: -len("down_proj")]
      for e in range(g.shape[0]):
        out[f"{base}{e}.down_proj.weight"] = g[e]
    else:
      out[name] = g
  return out
