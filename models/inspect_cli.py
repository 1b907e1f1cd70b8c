"""`launch.py --mode=model`: build the configured model, write and re-read it as a Hugging Face
checkpoint, score a batch, and print shapes and parameter counts."""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from models import qwen3_5


def _fmt(n: int) -> str:
  for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= div:
      return f"{n / div:.2f}{unit}"
  return str(n)


def main(config, flags_):
  del flags_
  cfg = qwen3_5.config_from_dict(config.model)
  counts = qwen3_5.count_params(cfg)
  print(f"model: {cfg.num_hidden_layers} layers, cycle {len(cfg.cycle)} x {cfg.num_cycles} "
        f"({', '.join(t.split('_')[0] for t in cfg.cycle)}), hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}, {'MoE' if cfg.use_moe else 'dense'}, dtype {cfg.dtype}")
  print(f"params: total {_fmt(counts['total'])}, active {_fmt(counts['active'])} "
        f"(embedding {_fmt(counts['embedding'])} excluded from active)")
  if counts["total"] > 2e9:
    print("too large to build on this machine; counts above are from shapes only")
    return
  params = qwen3_5.init_params(cfg, jax.random.key(config.seed))
  path = os.path.join(config.workdir, config.name, "hf_checkpoint")
  qwen3_5.save_hf(cfg, params, path)
  cfg, params = qwen3_5.load_hf(path, dtype=cfg.jnp_param_dtype)
  print(f"wrote and re-read a Hugging Face checkpoint at {path}")
  for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0][:12]:
    print(f"  {jax.tree_util.keystr(kp):60s} {str(leaf.shape):22s} {leaf.dtype}")
  print("  ...")
  batch, seq = 4, 96
  tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, jnp.int32)
  score = jax.jit(lambda p, t: jax.nn.log_softmax(qwen3_5.forward(cfg, p, t)[:, :-1]))
  t0 = time.time()
  logp = score(params, tokens)
  token_logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  token_logp.block_until_ready()
  print(f"scored a batch {tokens.shape} -> logits {logp.shape} float32 in {time.time() - t0:.1f}s "
        f"(incl. compile); mean token logprob {float(token_logp.mean()):.3f} "
        f"(uniform would be {-np.log(cfg.vocab_size):.3f})")
