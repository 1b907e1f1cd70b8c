"""Forward+backward throughput of the jitted model vs transformers on the same config and batch,
and compile time of an 8-layer vs a 40-layer model of the same width.

  python benchmarks/model_step.py                 # CPU, tiny-width MoE
  python benchmarks/model_step.py --hidden=1024 --dtype=bfloat16 --no_torch   # on an accelerator

Prints one line per figure and a JSON summary as the last line.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import base  # noqa: E402
from models import qwen3_5  # noqa: E402


def _cfg(args, layers):
  m = base.get_model_config()
  m.update(num_hidden_layers=layers, hidden_size=args.hidden, vocab_size=args.vocab,
           num_attention_heads=args.heads, num_key_value_heads=2, head_dim=args.head_dim,
           linear_num_key_heads=args.heads // 2, linear_num_value_heads=args.heads,
           linear_key_head_dim=args.head_dim, linear_value_head_dim=args.head_dim,
           num_experts=args.experts, num_experts_per_tok=args.topk,
           moe_intermediate_size=args.moe_ffn, shared_expert_intermediate_size=args.moe_ffn,
           param_dtype=args.dtype, dtype=args.dtype)
  return qwen3_5.config_from_dict(m)


def _loss(cfg, params, tokens):
  logits = qwen3_5.forward(cfg, params, tokens)
  logp = jax.nn.log_softmax(logits[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def jax_step_time(cfg, tokens, iters):
  params = qwen3_5.init_params(cfg, jax.random.key(0))
  step = jax.jit(jax.value_and_grad(lambda p, t: _loss(cfg, p, t)))
  t0 = time.perf_counter()
  compiled = step.lower(params, tokens).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(params, tokens))
  t0 = time.perf_counter()
  for _ in range(iters):
    out = compiled(params, tokens)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters, compile_s, params


def torch_step_time(cfg, params, tokens, iters):
  import torch  # lazy: the reference only (test dependencies), and heavy
  import transformers  # lazy: the reference only (test dependencies), and heavy
  with tempfile.TemporaryDirectory() as d:
    qwen3_5.save_hf(cfg, params, d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
  model.train()
  t = torch.from_numpy(np.asarray(tokens)).long()

  def step():
    model.zero_grad()
    logits = model(t).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             t[:, 1:].reshape(-1))
    loss.backward()

  step()
  t0 = time.perf_counter()
  for _ in range(iters):
    step()
  return (time.perf_counter() - t0) / iters


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--hidden", type=int, default=128)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--head_dim", type=int, default=32)
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--topk", type=int, default=2)
  ap.add_argument("--moe_ffn", type=int, default=128)
  ap.add_argument("--vocab", type=int, default=1024)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--no_torch", action="store_true")
  ap.add_argument("--compile_layers", default="8,40")
  args = ap.parse_args()
  print(f"devices: {jax.devices()}")

  cfg = _cfg(args, args.layers)
  tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, cfg.vocab_size)
  n_tok = args.batch * args.seq
  jax_s, _, params = jax_step_time(cfg, tokens, args.iters)
  out = {"tokens_per_step": n_tok, "jax_tokens_per_s": n_tok / jax_s,
         "params": qwen3_5.count_params(cfg)["total"]}
  print(f"jax   fwd+bwd: {n_tok / jax_s:10.0f} tokens/s ({jax_s * 1e3:.1f} ms/step)")
  if not args.no_torch:
    torch_s = torch_step_time(cfg, params, tokens, args.iters)
    out["torch_tokens_per_s"] = n_tok / torch_s
    out["speedup_vs_transformers"] = torch_s / jax_s
    print(f"torch fwd+bwd: {n_tok / torch_s:10.0f} tokens/s ({torch_s * 1e3:.1f} ms/step)")
    print(f"ratio jax/transformers: {torch_s / jax_s:.2f}x")
  compile_times = {}
  for layers in [int(x) for x in args.compile_layers.split(",")]:
    c = _cfg(args, layers)
    small = jax.random.randint(jax.random.key(2), (2, 128), 0, c.vocab_size)
    _, compile_s, _ = jax_step_time(c, small, 1)
    compile_times[layers] = compile_s
    print(f"compile fwd+bwd, {layers:3d} layers: {compile_s:.1f}s")
  lo, hi = min(compile_times), max(compile_times)
  out["compile_s"] = compile_times
  out["compile_ratio"] = compile_times[hi] / compile_times[lo]
  print(f"compile ratio {hi}/{lo} layers: {out['compile_ratio']:.2f}x")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
