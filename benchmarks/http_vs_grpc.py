"""Decode throughput of one rollout server over its two fronts: gRPC (token ids) vs the
OpenAI-compatible HTTP API, side by side.

    python benchmarks/http_vs_grpc.py                         # tiny config, CPU, 8 and 32 clients
    python benchmarks/http_vs_grpc.py --concurrency=8,32,64 --tokens=128 --set=model.dtype=bfloat16

One in-process server (the tiny default's model, `--slots` decode slots) with its gRPC port and
HTTP front (rl/rollout/openai_http.py). For each concurrency c, c client threads each send
`--rounds` requests back to back (a random `--prompt_len`-token prompt, `--tokens` tokens at
temperature 1 with stop ids off, so every request samples exactly that many), first over gRPC
(envs.harness.jetstream_client.TokenClient) and then over HTTP (POST /v1/completions with the
prompt as token ids and `return_token_ids`, one keep-alive connection per thread), each arm
timed twice and the better window kept (the CPU is shared). Prints sampled tokens/s over each
front, their ratio, and whether both fronts sampled the same ids for the same seeds (they should:
one engine, seeded draws). Asserts nothing.
"""
import argparse
import http.client
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import bench_overrides as overrides  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])

import jax  # noqa: E402
from envs.harness.jetstream_client import TokenClient  # noqa: E402
from envs.harness.policy import SamplingParams  # noqa: E402
from rl.rollout import serve  # noqa: E402


def load_config(args):
  c = overrides.load_config_file(args.config)
  c.rollout.slots = args.slots
  c.rollout.max_len = args.prompt_len + args.tokens + 8
  c.train.max_context = c.rollout.max_len
  c.rollout.prefill_buckets = (args.prompt_len,)
  c.rollout.prefix_cache = False
  c.rollout.turn_cache = 0
  overrides.apply(c, args.set)
  return c


def grpc_worker(address, jobs, out):
  client = TokenClient(address, timeout_s=600)
  try:
    for seed, prompt, n in jobs:
      out[seed] = client.generate(prompt, SamplingParams(temperature=1.0, seed=seed), n, []).ids
  finally:
    client.close()


def http_worker(port, model, jobs, out):
  conn = http.client.HTTPConnection("localhost", port, timeout=600)
  try:
    for seed, prompt, n in jobs:
      body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 1.0,
                         "seed": seed, "ignore_eos": True, "return_token_ids": True})
      conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
      r = conn.getresponse()
      data = json.loads(r.read())
      if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data}")
      out[seed] = data["choices"][0]["token_ids"]
  finally:
    conn.close()


def run(worker, target, c: int, rounds: int, prompts, tokens: int, seed0: int):
  """(sampled tokens/s, {seed: ids}) of c threads each sending `rounds` requests."""
  out: dict = {}
  threads = []
  for t in range(c):
    jobs = [(seed0 + t * rounds + r, prompts[(t * rounds + r) % len(prompts)], tokens)
            for r in range(rounds)]
    threads.append(threading.Thread(target=worker, args=(*target, jobs, out)))
  t0 = time.perf_counter()
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  wall = time.perf_counter() - t0
  return sum(len(v) for v in out.values()) / wall, out


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="configs/tiny_cpu.py")
  ap.add_argument("--set", action="append", default=[], help="config override key=value")
  ap.add_argument("--concurrency", default="8,32")
  ap.add_argument("--slots", type=int, default=32, help="the engine's decode slots")
  ap.add_argument("--tokens", type=int, default=64, help="sampled tokens per request")
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--rounds", type=int, default=3, help="requests per client thread")
  args = ap.parse_args()

  config = load_config(args)
  server = serve.build_server(config, port=0, warmup=True)
  front = serve.start_http(server, config, port=0)
  vocab = server.engine.cfg.vocab_size
  rng = np.random.default_rng(0)
  prompts = [rng.integers(10, vocab, args.prompt_len).tolist() for _ in range(64)]
  grpc_target, http_target = (server.address,), (front.port, front.model_name)
  print(f"device {jax.devices()[0].device_kind}; engine slots {server.engine.slots}, prompt "
        f"{args.prompt_len} tokens, {args.tokens} sampled per request, {args.rounds} requests "
        "per client", flush=True)
  try:
    for worker, target in ((grpc_worker, grpc_target), (http_worker, http_target)):
      run(worker, target, 2, 1, prompts, args.tokens, 0)   # compiles, connections
    print(f"{'clients':>7} {'gRPC tok/s':>11} {'HTTP tok/s':>11} {'HTTP/gRPC':>10} "
          f"{'same ids':>9}", flush=True)
    for c in (int(x) for x in args.concurrency.split(",")):
      best = {"grpc": (0.0, None), "http": (0.0, None)}
      for _ in range(2):
        for name, worker, target in (("grpc", grpc_worker, grpc_target),
                                     ("http", http_worker, http_target)):
          rate, ids = run(worker, target, c, args.rounds, prompts, args.tokens, 1000)
          if rate > best[name][0]:
            best[name] = (rate, ids)
      (g, g_ids), (h, h_ids) = best["grpc"], best["http"]
      print(f"{c:>7} {g:>11.1f} {h:>11.1f} {h / g:>9.2f}x {str(g_ids == h_ids):>9}", flush=True)
  finally:
    front.stop()
    server.stop()


if __name__ == "__main__":
  main()
