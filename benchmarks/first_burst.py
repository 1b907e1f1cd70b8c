"""Latency of the first burst of requests after `launch.py --mode=serve` starts, against later
bursts: what warmup leaves to compile on first use shows up as a slow first burst.

    python benchmarks/first_burst.py                       # tiny default, 3 bursts of 8 requests
    python benchmarks/first_burst.py --bursts=4 --burst=16 --serve_arg=--config.rollout.warmup=False

Starts `launch.py --mode=serve --config=CONFIG --http_port=0` as a user would (its own
process, the config's checkpoint, warmup as configured; `--serve_arg` adds a flag), waits until
it serves, then sends `--bursts` bursts of `--burst` concurrent requests over the OpenAI HTTP
API (one thread each), one burst after the other. Each burst mixes what clients send: chat
requests with the tools the config's worlds show (held-out level-1 tasks: the system turn all
of them share, then the task), plain chat requests without tools, and completions of token
prompts of varied lengths; `--max_tokens` tokens each at temperature 1, a new seed every
request. Prints the startup time, each burst's p50 and max latency, and the first burst's p50
over the median of the later bursts' p50s (1.0 = no cold start). Asserts nothing.
"""
import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import tiny_cpu  # noqa: E402
from envs import tasks as tasks_lib  # noqa: E402
from rl.rollout import serve  # noqa: E402


def start_server(config_path: str, extra: list) -> tuple:
  """(process, OpenAI base URL, seconds until it served) of `launch.py --mode=serve`."""
  log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
  t0 = time.monotonic()
  p = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch.py"), "--mode=serve",
                        f"--config={config_path}", "--port=0", "--http_port=0"] + extra,
                       cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
  while True:
    with open(log.name) as f:
      text = f.read()
    m = re.search(r"\((http://localhost:\d+/v1),", text)
    if m:
      return p, m.group(1), time.monotonic() - t0
    if p.poll() is not None:
      raise SystemExit("launch.py --mode=serve exited:\n" + text[-3000:])
    time.sleep(0.2)


def requests_for(config, n: int, offset: int, max_tokens: int) -> list:
  """`n` request bodies (kind, kwargs): tool chats, plain chats and token completions, in turn."""
  tasks = tasks_lib.load_split(config.envs, "eval")
  served = serve.served_tools(config)
  tools, system = served if served else (None, "")
  head = [{"role": "system", "content": system}] if system else []
  rng = np.random.default_rng(offset)
  out = []
  for i in range(offset, offset + n):
    seed = 1000 + i
    if i % 3 == 0 and tools:
      out.append(("chat", dict(messages=head + [{"role": "user", "content": tasks[i].prompt}],
                               tools=tools, max_tokens=max_tokens, seed=seed,
                               temperature=1.0)))
    elif i % 3 == 1:
      out.append(("chat", dict(messages=[{"role": "user", "content": f"Summarise report {i}."}],
                               max_tokens=max_tokens, seed=seed, temperature=1.0)))
    else:
      prompt = [int(x) for x in rng.integers(30, 900, int(rng.integers(8, 900)))]
      out.append(("completion", dict(prompt=prompt, max_tokens=max_tokens, seed=seed,
                                     temperature=1.0, extra_body={"ignore_eos": True})))
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny_cpu.py"))
  ap.add_argument("--bursts", type=int, default=3)
  ap.add_argument("--burst", type=int, default=8, help="concurrent requests a burst")
  ap.add_argument("--max_tokens", type=int, default=32)
  ap.add_argument("--serve_arg", action="append", default=[],
                  help="a flag for launch.py (repeatable), e.g. --config.rollout.warmup=False")
  args = ap.parse_args()
  config = tiny_cpu.get_config() if args.config.endswith("tiny_cpu.py") else None
  if config is None:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_overrides  # noqa: E402  (a sibling)
    config = bench_overrides.load_config_file(args.config)
  p, url, startup = start_server(args.config, args.serve_arg)
  api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
  model = api.models.list().data[0].id
  print(f"serving after {startup:.1f} s ({url}, model {model!r}); {args.bursts} bursts of "
        f"{args.burst} requests, {args.max_tokens} tokens each", flush=True)

  def one(req):
    kind, kw = req
    t = time.monotonic()
    if kind == "chat":
      api.chat.completions.create(model=model, **kw)
    else:
      api.completions.create(model=model, **kw)
    return time.monotonic() - t

  p50s = []
  try:
    for b in range(args.bursts):
      reqs = requests_for(config, args.burst, b * args.burst, args.max_tokens)
      with concurrent.futures.ThreadPoolExecutor(args.burst) as pool:
        lat = list(pool.map(one, reqs))
      p50s.append(float(np.median(lat)))
      print(f"burst {b + 1}: p50 {p50s[-1]:.3f} s  max {max(lat):.3f} s", flush=True)
  finally:
    p.terminate()
    p.wait(60)
  later = float(np.median(p50s[1:])) if len(p50s) > 1 else float("nan")
  print(f"first burst p50 / later bursts' p50: {p50s[0] / later:.2f}x "
        f"({p50s[0]:.3f} s vs {later:.3f} s)", flush=True)


if __name__ == "__main__":
  main()
