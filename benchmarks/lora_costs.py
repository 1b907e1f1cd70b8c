"""What LoRA's merge costs: a decode step and a train step, with and without adapters.

  python benchmarks/lora_costs.py                     # the ~1B MoE (an accelerator)
  python benchmarks/lora_costs.py --size=smoke        # the tiny shapes (CPU)

Arms, side by side (models/lora.py, docs/lora.md):

  decode, merged   one decode step of --batch sequences on the plain model whose weights hold
                   the adapters merged: what the rollout engine runs after a weight sync.
  decode, per step the same step with the adapters attached (lora.attach): every step merges
                   each layer's adapted weights again, as applying them in the forward would.
  train, full      forward + backward of the token logprobs over --rows x --seq tokens, the
                   gradient taken for every param (float32 params).
  train, lora      the same with a bfloat16 base and float32 adapters, the gradient taken for
                   the adapters alone (the merge inside the layer scan).

For each: the median time of --reps runs after a warm-up, and the compiled program's temporary
bytes (`memory_analysis`: what it holds beyond its inputs and outputs) and output bytes (the
gradients). The model is the accelerator benchmark's (benchmarks/accelerator.py SIZES), in
bfloat16 compute. The last line is JSON.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from models import config as config_lib  # noqa: E402
from models import lora  # noqa: E402
from models import qwen3_5  # noqa: E402

MiB = 1 << 20
# benchmarks/accelerator.py SIZES, restated so that this runs where only the model's
# dependencies are installed (an accelerator image without the project's config package).
SIZES = {
    "1b": dict(hidden=1024, layers=12, heads=8, head_dim=128, experts=64, topk=2, moe_ffn=384,
               vocab=32768),
    "smoke": dict(hidden=64, layers=4, heads=4, head_dim=16, experts=8, topk=2, moe_ffn=32,
                  vocab=1024),
}
# The default LoRA targets (configs/base.py lora.targets).
TARGETS = (r"(mixer/(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|out_proj)"
           r"|ffn/(shared_)?(gate_proj|up_proj|down_proj)|ffn/(wi_gate|wi_up|wo))$",)


def model_config(size: dict, param_dtype: str) -> config_lib.ModelConfig:
  h, heads, hd = size["hidden"], size["heads"], size["head_dim"]
  return config_lib.ModelConfig(
      vocab_size=size["vocab"], hidden_size=h, num_hidden_layers=size["layers"],
      layer_types=config_lib.default_layer_types(size["layers"], 4),
      num_attention_heads=heads, num_key_value_heads=2, head_dim=hd, partial_rotary_factor=0.25,
      rope_theta=1e7, linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
      linear_key_head_dim=hd, linear_value_head_dim=hd, linear_conv_kernel_dim=4,
      gdn_chunk_size=-1, use_moe=True, intermediate_size=0, num_experts=size["experts"],
      num_experts_per_tok=size["topk"], norm_topk_prob=True, moe_intermediate_size=size["moe_ffn"],
      shared_expert_intermediate_size=size["moe_ffn"], rms_norm_eps=1e-6,
      tie_word_embeddings=False, max_position_embeddings=1 << 20, param_dtype=param_dtype,
      dtype="bfloat16", initializer_range=0.02, scan_layers=True, remat="full")


def _timed(fn, args, reps: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _measure(name, fn, args, reps):
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  s = _timed(compiled, args, reps)
  row = {"arm": name, "ms": round(1e3 * s, 3),
         "temp_mib": round(mem.temp_size_in_bytes / MiB, 1) if mem else None,
         "out_mib": round(mem.output_size_in_bytes / MiB, 1) if mem else None}
  print(f"  {name:18s} {row['ms']:10.2f} ms   temporaries {row['temp_mib']} MiB   "
        f"outputs {row['out_mib']} MiB", flush=True)
  return row


def _adapters(spec, cfg, params, key):
  """Adapters as after training (B away from zero)."""
  a = lora.init(spec, qwen3_5.param_axes(cfg), params, key)
  return jax.tree_util.tree_map_with_path(
      lambda p, x: 0.01 * jax.random.normal(key, x.shape) if p[-1].key == "b" else x, a)


def decode_arms(size, batch, context, rank, reps):
  cfg = model_config(size, "bfloat16")
  spec = lora.LoraSpec(rank, 2.0 * rank, TARGETS)
  params = jax.jit(lambda k: qwen3_5.init_params(cfg, k))(jax.random.key(0))
  adapters = _adapters(spec, cfg, params, jax.random.key(1))
  merged = jax.jit(lambda p, a: lora.merge(p, a, spec.scale))(params, adapters)
  cache = qwen3_5.init_cache(cfg, batch, context)
  cache["pos"] = jnp.full((batch,), context // 2, jnp.int32)
  tokens = jnp.zeros((batch,), jnp.int32)
  step = lambda p, c, t: qwen3_5.decode_step(cfg, p, c, t)[0]
  attached = lambda p, a, c, t: qwen3_5.decode_step(cfg, lora.attach(p, a, spec.scale), c, t)[0]
  print(f"decode: {batch} sequences at position {context // 2} of {context}, rank {rank}")
  return [_measure("decode, merged", step, (merged, cache, tokens), reps),
          _measure("decode, per step", attached, (params, adapters, cache, tokens), reps)]


def train_arms(size, rows, seq, rank, reps):
  tokens = jax.random.randint(jax.random.key(2), (rows, seq), 0, size["vocab"])
  spec = lora.LoraSpec(rank, 2.0 * rank, TARGETS)

  def loss(cfg, params, t):
    hidden, _ = qwen3_5.forward_hidden(cfg, params, t)
    lp, _ = qwen3_5.token_logprobs(cfg, params, hidden[:, :-1], t[:, 1:])
    return jnp.mean(lp)

  full_cfg = model_config(size, "float32")
  params = jax.jit(lambda k: qwen3_5.init_params(full_cfg, k))(jax.random.key(0))
  print(f"train: {rows} rows of {seq} tokens, remat=full, rank {rank}")
  out = [_measure("train, full", jax.grad(lambda p, t: loss(full_cfg, p, t)), (params, tokens),
                  reps)]
  del params
  cfg = model_config(size, "bfloat16")
  base = jax.jit(lambda k: qwen3_5.init_params(cfg, k))(jax.random.key(0))
  adapters = _adapters(spec, cfg, base, jax.random.key(1))
  grad = jax.grad(lambda a, b, t: loss(cfg, lora.attach(b, a, spec.scale), t))
  out.append(_measure("train, lora", grad, (adapters, base, tokens), reps))
  out[-1]["adapter_mib"] = round(lora.byte_count(adapters) / MiB, 2)
  out[-1]["base_mib"] = round(lora.byte_count(base) / MiB, 1)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--size", default="1b", choices=sorted(SIZES))
  ap.add_argument("--rank", type=int, default=8)
  ap.add_argument("--batch", type=int, default=32, help="decode sequences")
  ap.add_argument("--context", type=int, default=4096, help="decode cache length")
  ap.add_argument("--rows", type=int, default=4)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--reps", type=int, default=5)
  args = ap.parse_args()
  size = SIZES[args.size]
  print(f"{jax.devices()[0].device_kind} ({jax.default_backend()}), size {args.size}", flush=True)
  rows = decode_arms(size, args.batch, args.context, args.rank, args.reps)
  rows += train_arms(size, args.rows, args.seq, args.rank, args.reps)
  print(json.dumps({"device": jax.devices()[0].device_kind, "size": args.size,
                    "rank": args.rank, "arms": rows}))


if __name__ == "__main__":
  main()
