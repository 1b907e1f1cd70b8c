"""Throughput of the GRPO train step: tokens/s, and MFU on a GPU/TPU.

  python benchmarks/train_step.py --config=configs/tiny_cpu.py
  python benchmarks/train_step.py --config=configs/tiny_cpu.py --config.train.seq_len=512 --steps=5

Builds the configured model and mesh over the devices present, feeds a synthetic GRPO batch
of the configured shape (prompts_per_step x samples_per_prompt rows of train.seq_len tokens)
and times `--steps` steps after one compile step (the figures, and device 0's peak
memory where the backend keeps statistics (benchmarks/device_memory.py), also as a JSON last line). Model FLOPs are counted from the config:
6 x (active parameters per token) x tokens for the matmuls (forward + backward), plus the
attention score/value matmuls of the full-attention layers (causal: half of 4 T^2 H D per
layer per sequence, x3 for the backward); the optional recompute of old logprobs and remat
are not counted (MFU counts model FLOPs, not hardware FLOPs). Prints figures; asserts none.

  python benchmarks/train_step.py --config=configs/tiny_cpu.py --live_groups=4 \
      --config.train.prompts_per_step=16 --config.train.micro_batches=8

With --live_groups=K only K prompt groups carry signal (the others all pass: filtered, as
most groups are in a GRPO batch of a small policy) and the step is timed twice in the same
run: rows as they come (every micro-batch holds a live row, so all are computed) and packed
by `rl.reductions.pack_live_rows` (as `rl.batch.build_batch` feeds the step: all-dead micro-batches skipped).

  python benchmarks/train_step.py --config=configs/tiny_cpu.py --bucket=1024

With --bucket=N the trajectories end by token N and the step is timed twice in the same run:
padded to train.seq_len and padded to N (train.seq_buckets: the step's rows are as long as its
longest trajectory's bucket).
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import device_memory  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])

if __name__ == "__main__":
  device_memory.set_policy()  # before jax loads: this process's allocator (device_memory.py)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from models import qwen3_5  # noqa: E402
from models import sharding  # noqa: E402
from rl import reductions  # noqa: E402
from rl import train_step  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_cpu.py", "Config file.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps (after one compile step).")
_LIVE = flags.DEFINE_integer("live_groups", -1, "Groups with signal (the rest filtered); "
                             "< 0 = all. >= 0 also times the packed batch (dead micro-batches "
                             "skipped) against the unpacked one.")

# Dense bf16 peak FLOP/s per device, by substring of jax's device_kind.
_BUCKET = flags.DEFINE_integer("bucket", 0, "> 0: trajectories end by this token; also times "
                               "them padded to it (train.seq_buckets) against train.seq_len.")

_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "v5p": 459e12,
         "v5e": 197e12, "v5 lite": 197e12, "v4": 275e12, "v6": 918e12}


def model_flops_per_step(mc, rows: int, seq: int, loss_tokens: int) -> float:
  counts = qwen3_5.count_params(mc)
  tokens = rows * seq
  dense = 6.0 * counts["active"] * tokens
  n_attn = sum(1 for t in mc.layer_types if t == "full_attention")
  attn = 3 * n_attn * rows * 2 * seq * seq * mc.num_attention_heads * mc.head_dim  # causal half of 4TTHD, x3
  del loss_tokens
  return dense + attn


def peak_flops(device) -> float | None:
  kind = getattr(device, "device_kind", "")
  for k, v in _PEAK.items():
    if k.lower() in kind.lower():
      return v
  return None


def synthetic_batch(config, seed=0):
  rng = np.random.default_rng(seed)
  g, s, t = config.train.prompts_per_step, config.train.samples_per_prompt, config.train.seq_len
  b = g * s
  prompt = max(t // 8, 1)
  mask = np.zeros((b, t), np.float32)
  mask[:, prompt:] = 1.0
  rewards = rng.integers(0, 2, size=b).astype(np.float32)
  rewards[::s], rewards[1::s] = 1.0, 0.0
  return {
      "tokens": rng.integers(0, config.model.vocab_size if not config.model.preset else 1000,
                             size=(b, t)).astype(np.int32),
      "loss_mask": mask,
      "rollout_logprobs": (np.log(rng.uniform(0.05, 0.95, size=(b, t))) * mask).astype(np.float32),
      "rewards": rewards,
      "group_ids": np.repeat(np.arange(g), s).astype(np.int32),
  }


def main(argv):
  del argv
  config = _CONFIG.value
  if _BUCKET.value > 0:
    config.train.seq_buckets = (_BUCKET.value,)
  mesh = sharding.make_mesh(config.mesh)
  step = train_step.TrainStep(config, mesh)
  mc = step.model_cfg
  state = step.init_state(jax.random.key(config.seed))
  host = synthetic_batch(config)
  packed_dt = None
  if _LIVE.value >= 0:
    s = config.train.samples_per_prompt
    host["rewards"][_LIVE.value * s:] = 1.0          # groups past the first K: all pass
    live = reductions.live_rows(host["rewards"], host["group_ids"], np.ones(len(host["rewards"]), bool),
                          host["loss_mask"], config.rl.filter_zero_variance)
    # Unpacked: live rows at the front, so the strided split puts one in every micro-batch.
    packed = reductions.pack_live_rows(host, live, step.micro_batches(len(live)))
  short = None
  if _BUCKET.value > 0:
    n = _BUCKET.value
    for k in ("tokens", "loss_mask", "rollout_logprobs"):
      host[k][:, n:] = 0
    short = {k: v[:, :n] if v.ndim == 2 else v for k, v in host.items()}
  batch = step.shard_batch(host)
  rows, seq = host["tokens"].shape

  def timed(state, batch):
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    times = []
    for _ in range(_STEPS.value):
      t0 = time.perf_counter()
      state, m = step(state, batch)
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t0)
    return state, m, first, float(np.median(times))

  state, m, compile_s, dt = timed(state, batch)
  if _LIVE.value >= 0:
    state, _, _, packed_dt = timed(state, step.shard_batch(packed))
  if short is not None:
    state, m_short, short_compile_s, short_dt = timed(state, step.shard_batch(short))
  tokens = rows * seq
  flops = model_flops_per_step(mc, rows, seq, int(host["loss_mask"].sum()))
  dev = jax.devices()[0]
  n = jax.device_count()
  counts = qwen3_5.count_params(mc)
  print(f"config            {config.name} (preset {config.model.preset or '-'}), "
        f"params {counts['total'] / 1e6:.2f} M total / {counts['active'] / 1e6:.2f} M active")
  print(f"devices           {n} x {dev.platform}:{getattr(dev, 'device_kind', '?')}, mesh {sharding.describe(mesh)}")
  print(f"batch             {rows} rows x {seq} tokens, {step.micro_batches(rows)} micro-batch(es), "
        f"dtype {config.model.dtype}, remat {config.model.remat}")
  print(f"first step        {compile_s:.2f} s (compile + run)")
  print(f"step time         {dt * 1e3:.1f} ms (median of {_STEPS.value})")
  print(f"throughput        {tokens / dt:,.0f} tokens/s ({tokens / dt / n:,.0f} per device)")
  print(f"model FLOPs/step  {flops:.3e}  ->  {flops / dt / n / 1e12:.3f} TFLOP/s per device")
  peak = peak_flops(dev)
  if dev.platform != "cpu" and peak:
    print(f"MFU               {100 * flops / dt / n / peak:.1f}% of {peak / 1e12:.0f} TFLOP/s bf16 peak")
  else:
    print("MFU               n/a (no accelerator with a known peak)")
  print(f"loss              {float(m['loss/total']):.5f}")
  peak_mem = device_memory.peak_bytes_in_use()   # the whole run's; None on the CPU
  print("peak memory       " + ("n/a (no allocator statistics)" if peak_mem is None
                                else f"{peak_mem / 2**30:.2f} GiB (device 0)"))
  if packed_dt is not None:
    n_live = int(live.sum())
    print(f"live rows         {n_live} of {rows} ({_LIVE.value} informative groups)")
    print(f"step, unpacked    {dt * 1e3:.1f} ms (every micro-batch computed)")
    print(f"step, packed      {packed_dt * 1e3:.1f} ms (all-dead micro-batches skipped): "
          f"{dt / packed_dt:.2f}x faster")
  if short is not None:
    # The loss differs by the timed steps in between (each step updates the state).
    print(f"rows of {seq}      {dt * 1e3:.1f} ms (train.seq_len)")
    print(f"rows of {_BUCKET.value:<6d}    {short_dt * 1e3:.1f} ms (bucket; first step {short_compile_s:.1f} s "
          f"with its compile): {short_dt / dt:.3f}x the time")
  print(json.dumps({
      "params": counts["total"], "active_params": counts["active"], "rows": rows, "seq": seq,
      "devices": n, "device_kind": getattr(dev, "device_kind", "?"), "dtype": config.model.dtype,
      "param_dtype": config.model.param_dtype,
      "first_step_s": compile_s, "step_s": dt, "tokens_per_s": tokens / dt,
      "model_flops_per_step": flops,
      "mfu": flops / dt / n / peak if (dev.platform != "cpu" and peak) else None,
      "peak_bytes_in_use": peak_mem}))


if __name__ == "__main__":
  app.run(main)
