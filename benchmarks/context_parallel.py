"""Context parallelism (models.sharding.context_parallel_rules) against rows-only layouts, side by
side: the GRPO train step of the tiny default's model with the full-size recipe's long-context
settings (full remat, query-chunked attention, chunked logits) on 8 host devices, mesh
(1, 8, 1, 1).

  python benchmarks/context_parallel.py                  # 8 rows of 4096 tokens
  python benchmarks/context_parallel.py --seq=8192 --rounds=1

Arms (same batch, same state):
  rows, 1 a micro-batch    8 micro-batches of 1 row; the row cannot be split over the 8 batch
                           devices, so every device computes all of it (what the full-size
                           configs had when a micro-batch held fewer rows than devices)
  rows, 1 a device         1 micro-batch of 8 rows, one row per device
  context parallel         8 micro-batches of 1 row, its tokens split over the 8 devices
Prints, per arm, the compiled step's temporary memory per device (XLA's memory analysis: the
activations' share of a device), the median step time, and the largest difference of its loss
and gradients from the first arm's. The host devices share this machine's cores, so the times
compare the arms' work, not what accelerators would take.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import tiny_cpu  # noqa: E402
from models import sharding  # noqa: E402
from rl import train_step  # noqa: E402


def _config(seq: int, micro_batches: int, context_parallel: bool):
  c = tiny_cpu.get_config()
  c.unlock()
  c.mesh.shape = (1, 8, 1, 1)
  c.train.prompts_per_step, c.train.samples_per_prompt = 2, 4
  c.train.seq_len = c.train.max_context = seq
  c.train.micro_batches = micro_batches
  c.model.remat = "full"
  c.model.attention_causal_block = 0
  c.model.attention_query_chunk = 512
  c.model.logits_chunk = 512
  c.rl.filter_zero_variance = False
  if context_parallel:
    c.mesh.rules = sharding.context_parallel_rules(c.mesh.rules, "fsdp")
  return c


def _batch(c, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  b, t = c.train.prompts_per_step * c.train.samples_per_prompt, c.train.seq_len
  tokens = rng.integers(3, c.model.vocab_size, size=(b, t)).astype(np.int32)
  lengths = rng.integers(t // 2, t + 1, size=b)
  mask = ((np.arange(t)[None] >= 256) & (np.arange(t)[None] < lengths[:, None])).astype(np.float32)
  rewards = np.tile(np.array([1.0, 0.0, 1.0, 0.0], np.float32), c.train.prompts_per_step)
  return {"tokens": tokens, "loss_mask": mask, "rewards": rewards,
          "rollout_logprobs": (np.log(rng.uniform(0.05, 0.9, size=(b, t))) * mask).astype(np.float32),
          "group_ids": np.repeat(np.arange(c.train.prompts_per_step), 4).astype(np.int32)}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--rounds", type=int, default=2)
  args = ap.parse_args()
  arms = [("rows, 1 a micro-batch", 8, False), ("rows, 1 a device", 1, False),
          ("context parallel", 8, True)]
  steps, batches, states = {}, {}, {}
  host_state = None
  for name, micro, cp in arms:
    c = _config(args.seq, micro, cp)
    step = train_step.TrainStep(c, sharding.make_mesh(c.mesh), return_grads=True)
    if host_state is None:
      host_state = jax.device_get(step.init_state(jax.random.key(0)))
    batch = step.shard_batch(_batch(c))
    t0 = time.perf_counter()
    compiled = step.lower(step.abstract_state(), batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"{name:24s} compiled in {time.perf_counter() - t0:5.1f} s", flush=True)
    steps[name], batches[name], states[name] = step, batch, temp
  times = {name: [] for name, _, _ in arms}
  results = {}
  for _ in range(args.rounds):
    for name, _, _ in arms:
      step = steps[name]
      state = jax.device_put(host_state, step.state_shardings)
      t0 = time.perf_counter()
      _, m = step(state, batches[name])
      m = jax.block_until_ready(m)
      times[name].append(time.perf_counter() - t0)
      results[name] = jax.device_get(m)
  ref_name = arms[0][0]
  ref = results[ref_name]
  print(f"\n8 rows of {args.seq} tokens, mesh (1, 8, 1, 1), {args.rounds} round(s)")
  print(f"{'arm':24s} {'temp / device':>14s} {'ratio':>6s} {'step s':>8s} {'ratio':>6s} "
        f"{'|d loss|':>9s} {'max |d grad| / max |grad|':>26s}")
  for name, _, _ in arms:
    m = results[name]
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(ref["grads"]))
    dgrad = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(m["grads"]),
                                                          jax.tree.leaves(ref["grads"])))
    t, t_ref = float(np.median(times[name])), float(np.median(times[ref_name]))
    print(f"{name:24s} {states[name] / 2**20:10.1f} MiB {states[name] / states[ref_name]:6.3f} "
          f"{t:8.2f} {t / t_ref:6.3f} {abs(float(m['loss/total']) - float(ref['loss/total'])):9.2e} "
          f"{dgrad / scale:26.2e}")


if __name__ == "__main__":
  main()
