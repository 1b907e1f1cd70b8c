"""Decode throughput of the JetStream engine vs transformers `generate`, same weights.

    python benchmarks/decode.py                                  # tiny config, CPU, 1/8/32
    python benchmarks/decode.py --skip_hf --max_len=64,4096      # cost of the cache's capacity
    python benchmarks/decode.py --dtype=bfloat16 --skip_hf \
        --set=model.hidden_size=2048 --set=model.num_hidden_layers=8 ...   # a bigger one, GPU
    python benchmarks/decode.py --skip_hf --temperature=1           # sampled, as RL rollouts are

For each concurrency c the engine gets c slots, c prompts are prefilled and inserted, and
`--tokens` generate steps are timed, half of them blocking (each step's tokens and logprobs on
the host before the next starts) and half pipelined (one step in flight while the last one's
results are copied, as JetStream's generate thread runs); both rates are printed. transformers builds its model from the same weights (qwen3_5.save_hf ->
AutoModelForCausalLM.from_pretrained) and runs greedy `generate` on the same prompts; its
decode rate is c * (N - 1) / (t(N new tokens) - t(1 new token)), prefill excluded. Prints
tokens/s of both and their ratio, and the figures as a JSON last line; asserts nothing.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import device_memory  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])

if __name__ == "__main__":
  device_memory.set_policy()  # before jax loads: this process's allocator (device_memory.py)

import numpy as np  # noqa: E402

import bench_overrides as overrides  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])

import jax  # noqa: E402
from models import qwen3_5  # noqa: E402
from rl.rollout.engine import PrefillInput, QwenEngine, SamplingSettings  # noqa: E402


def load_config(args):
  c = overrides.load_config_file(args.config)
  overrides.apply(c, args.set)
  c.model.dtype = args.dtype
  c.model.param_dtype = args.dtype
  return c


def bench_engine(config, params, prompts, tokens: int, max_len: int = 0,
                 temperature: float = 0.0) -> dict:
  """Engine decode tokens/s with len(prompts) slots, two ways:

  blocking   each step's tokens and logprobs reach the host before the next step starts
             (a client that reads every token before asking for the next);
  pipelined  the next step is dispatched before the last one's results are read, one step in
             flight, as JetStream's generate thread runs (it copies to the host asynchronously
             and hands the results to its detokenize thread): the device never waits on the host.
  """
  c = len(prompts)
  n = prompts.shape[1]
  engine = QwenEngine.from_config(config, params=params, slots=c,
                                  max_len=max_len or n + tokens + 8, prefill_buckets=(n,))
  handle = engine.load_params()
  state = engine.init_decode_state()
  for slot, p in enumerate(prompts):
    prefix = engine.prefill(params=handle, padded_tokens=PrefillInput(
        np.asarray(p, np.int32), SamplingSettings(temperature=temperature)), true_length=n)
    state = engine.insert(prefix, state, slot)
  for _ in range(2):  # compile + one warm step
    state, res = engine.generate(handle, state)
    res.convert_to_numpy()
  rates = {"blocking": 0.0, "pipelined": 0.0}
  for _ in range(2):  # keep the better of two windows (the CPU is shared)
    t0 = time.perf_counter()
    for _ in range(tokens // 2):
      state, res = engine.generate(handle, state)
      res.copy_to_host_async()
      res.convert_to_numpy()
    rates["blocking"] = max(rates["blocking"], c * (tokens // 2) / (time.perf_counter() - t0))
    t0 = time.perf_counter()
    last = None
    for _ in range(tokens // 2):
      state, res = engine.generate(handle, state)
      res.copy_to_host_async()
      if last is not None:
        last.convert_to_numpy()
      last = res
    last.convert_to_numpy()
    rates["pipelined"] = max(rates["pipelined"], c * (tokens // 2) / (time.perf_counter() - t0))
  jax.block_until_ready(state)
  return rates


def bench_hf(path, prompts, tokens: int, dtype: str) -> float:
  import torch  # lazy: the reference only (test dependencies), and heavy
  import transformers  # lazy: the reference only (test dependencies), and heavy
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=getattr(torch, dtype))
  model.eval()
  ids = torch.tensor(np.asarray(prompts), dtype=torch.long)
  mask = torch.ones_like(ids)

  class StepClock(transformers.StoppingCriteria):
    """Called once per generated token: timestamps the steps, stops nothing."""

    def __init__(self):
      self.times = []

    def __call__(self, input_ids, scores, **kwargs):
      self.times.append(time.perf_counter())
      return torch.zeros(input_ids.shape[0], dtype=torch.bool)

  best = 0.0
  for _ in range(2):  # the first run also warms up; keep the better one
    clock = StepClock()
    with torch.no_grad():
      out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False, pad_token_id=0, eos_token_id=None,
                           stopping_criteria=transformers.StoppingCriteriaList([clock]))
    assert out.shape[1] == ids.shape[1] + tokens
    # From the first token's timestamp (prefill done) to the last: tokens - 1 decode steps.
    best = max(best, len(prompts) * (tokens - 1) / (clock.times[-1] - clock.times[0]))
  return best


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="configs/tiny_cpu.py")
  ap.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
  ap.add_argument("--concurrency", default="1,8,32")
  ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
  ap.add_argument("--prompt_len", type=int, default=16)
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--skip_hf", action="store_true", help="engine only (e.g. on a GPU)")
  ap.add_argument("--max_len", default="",
                  help="the engine's cache capacity (default: just what the run needs); a comma "
                       "list times the engine at each, one after the other, with each rate's "
                       "ratio to the first's (a rollout engine's capacity is rollout.max_len)")
  ap.add_argument("--temperature", type=float, default=0.0,
                  help="the engine's requests: 0 = greedy (as transformers' generate runs "
                  "here), 1 = the recipe's sampling (a draw over the vocabulary every token)")
  ap.add_argument("--torch_threads", type=int, default=0, help="0 = torch's default")
  args = ap.parse_args()

  config = load_config(args)
  cfg = qwen3_5.config_from_dict(config.model)
  params = qwen3_5.init_params(cfg, jax.random.key(config.seed))
  counts = qwen3_5.count_params(cfg)
  print(f"device {jax.devices()[0].device_kind} x{jax.device_count()}; model {counts['total']/1e6:.1f}M "
        f"params ({counts['active']/1e6:.1f}M active), {args.dtype}; prompt {args.prompt_len}, "
        f"{args.tokens} decode steps", flush=True)
  conc = [int(x) for x in args.concurrency.split(",")]
  needed = args.prompt_len + args.tokens + 8
  capacities = [int(x) for x in args.max_len.split(",")] if args.max_len else [needed]
  if min(capacities) < needed:
    ap.error(f"--max_len: every capacity must hold prompt + tokens + 8 = {needed} positions")
  rng = np.random.default_rng(0)
  hf_dir = None
  if not args.skip_hf:
    import torch  # lazy: the reference only (test dependencies), and heavy
    if args.torch_threads:
      torch.set_num_threads(args.torch_threads)
    hf_dir = tempfile.mkdtemp(prefix="decode_bench_")
    qwen3_5.save_hf(cfg, params, hf_dir)
  print(f"{'conc':>5} {'engine tok/s':>13} {'pipelined':>10} {'hf tok/s':>10} {'ratio':>7}",
        flush=True)
  out = {"device": jax.devices()[0].device_kind, "params": counts["total"],
         "active_params": counts["active"], "dtype": args.dtype, "prompt_len": args.prompt_len,
         "tokens": args.tokens, "temperature": args.temperature, "engine_tokens_per_s": {}, "engine_pipelined_tokens_per_s": {},
         "hf_tokens_per_s": {}, "max_len": capacities, "engine_tokens_per_s_by_max_len": {}}
  for c in conc:
    prompts = rng.integers(10, cfg.vocab_size, size=(c, args.prompt_len))
    by_cap = [bench_engine(config, params, prompts, args.tokens, cap, args.temperature)
              for cap in capacities]
    out["engine_tokens_per_s_by_max_len"][c] = {cap: r["blocking"]
                                                for cap, r in zip(capacities, by_cap)}
    if len(capacities) > 1:
      print(f"{c:>5} " + ", ".join(
          f"max_len {cap}: {r['blocking']:.1f} tok/s ({r['blocking'] / by_cap[0]['blocking']:.2f}x)"
          for cap, r in zip(capacities, by_cap)), flush=True)
    rates = by_cap[0]
    eng, pipe = rates["blocking"], rates["pipelined"]
    out["engine_tokens_per_s"][c] = eng
    out["engine_pipelined_tokens_per_s"][c] = pipe
    if hf_dir:
      hf = bench_hf(hf_dir, prompts, args.tokens, args.dtype)
      out["hf_tokens_per_s"][c] = hf
      print(f"{c:>5} {eng:>13.1f} {pipe:>10.1f} {hf:>10.1f} {eng / hf:>6.1f}x", flush=True)
    else:
      print(f"{c:>5} {eng:>13.1f} {pipe:>10.1f} {'-':>10} {'-':>7}", flush=True)
  out["peak_bytes_in_use"] = device_memory.peak_bytes_in_use()   # the whole run's; CPU: None
  peak = out["peak_bytes_in_use"]
  print("peak device memory: " + ("n/a" if peak is None else f"{peak / 2**30:.2f} GiB"))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
