"""Agent-world figures: generation, gateway start, tool-call latency, oracle episodes/s.

  python benchmarks/worlds.py [--concurrency=1,8,32] [--episodes=64] [--transport=mcp]

Prints figures only (no asserts). Episodes/s is measured with the oracle policy on eval tasks,
each concurrent episode stream holding its own gateway process and world working copy.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import base  # noqa: E402
from envs import scripted_eval  # noqa: E402
from envs import sandbox  # noqa: E402
from envs import tasks as tasks_lib  # noqa: E402
from envs import worlds  # noqa: E402
from envs.apps import gateway as gateway_lib  # noqa: E402
from envs.apps import worldstate  # noqa: E402
from envs.worlds import render  # noqa: E402


def _pct(xs, q):
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--concurrency", default="1,8,32")
  ap.add_argument("--episodes", type=int, default=128,
                  help="episodes per concurrency level (at least 4 per stream)")
  ap.add_argument("--transport", default="mcp", choices=("mcp", "local"))
  ap.add_argument("--calls", type=int, default=50, help="calls per tool in the latency test")
  args = ap.parse_args()
  cfg = base.get_config().envs
  tmp = tempfile.mkdtemp(prefix="bench_worlds_")
  try:
    _bench(args, cfg, tmp)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _bench(args, cfg, tmp):
  print(f"cpus: {os.cpu_count()}  sandbox isolation: {sandbox.isolation(cfg.sandbox)}")

  # 1. World generation (all worlds, generation_workers processes) and one world alone.
  t = time.perf_counter()
  spec = worlds.spec_for(cfg, "investment_banking", 0)
  worlds.generate_world(cfg, spec, os.path.join(tmp, "one"))
  one = time.perf_counter() - t
  nfiles = sum(len(f) for _, _, f in os.walk(os.path.join(tmp, "one")))
  t = time.perf_counter()
  root = worlds.ensure_worlds(cfg, os.path.join(tmp, "all"))
  allw = time.perf_counter() - t
  n = 3 * cfg.worlds_per_domain
  print(f"world generation: one world {one:.2f}s ({nfiles} files); all {n} worlds {allw:.1f}s "
        f"with {cfg.generation_workers} workers ({allw / n:.2f}s/world)")
  t = time.perf_counter()
  ev = tasks_lib.load_split(cfg, "eval")
  tr = tasks_lib.load_split(cfg, "train")
  print(f"task generation: {len(tr)} train + {len(ev)} eval in {time.perf_counter() - t:.2f}s")

  # 2. Gateway start (spawn + MCP handshake + tool listing) and tool-call latency.
  inst = worldstate.WorldInstance(os.path.join(root, "in00"), os.path.join(tmp, "work"))
  starts = []
  for _ in range(5):
    t = time.perf_counter()
    gw = gateway_lib.Gateway(inst.path, cfg)
    gw.list_tools()
    starts.append(time.perf_counter() - t)
    gw.close()
  print(f"gateway start (spawn+handshake+list_tools): median {statistics.median(starts):.2f}s "
        f"min {min(starts):.2f}s over {len(starts)}")
  e = spec["entities"][0]
  probes = [("filesystem_list_directory", {"path": "/"}),
            ("spreadsheets_read_sheet", {"path": "/" + render.entity_paths(spec, e)["xlsx"]}),
            ("pdfs_read_pdf", {"path": "/" + render.entity_paths(spec, e)["pdf"]}),
            ("documents_read_document", {"path": "/" + render.entity_paths(spec, e)["docx"]}),
            ("mail_search_messages", {"query": e["name"]}),
            ("code_execution_run_python", {"code": "print(6 * 7)"})]
  with gateway_lib.Gateway(inst.path, cfg) as gw:
    for name, a in probes:
      k = args.calls if name != "code_execution_run_python" else max(5, args.calls // 5)
      lat = []
      for _ in range(k):
        t = time.perf_counter()
        r = gw.call_tool(name, a)
        lat.append(time.perf_counter() - t)
        assert not r.is_error, r.text
      print(f"tool latency {name:28s} p50 {1e3 * _pct(lat, .5):7.1f} ms  "
            f"p90 {1e3 * _pct(lat, .9):7.1f} ms  (n={k})")
  inst.close()

  # 3. Oracle episodes/s at several concurrency levels (each stream: own gateway + copy).
  for c in [int(x) for x in args.concurrency.split(",")]:
    # Tasks from as many worlds as streams, so every stream has its own world working copy.
    by_world = {}
    for tk in ev + tr:
      by_world.setdefault(tk.world_id, []).append(tk)
    wids = sorted(by_world, key=lambda w: (-len(by_world[w]), w))
    per = max(4, args.episodes // c)
    sel = []
    for i in range(c):
      ws = by_world[wids[i % len(wids)]]
      sel += ws[(i // len(wids)) * per:(i // len(wids) + 1) * per]
    t = time.monotonic()
    timing = {}
    outs = scripted_eval.run_tasks(sel, cfg, "oracle", args.transport, c, root,
                              work_root=os.path.join(tmp, f"w{c}"), timing=timing)
    dt = time.monotonic() - t
    ok = sum(o.passed for o in outs)
    ep = [o.wall_s for o in outs]
    # Steady state: all gateways up before the clock starts.
    steady = len(outs) / (timing["done"] - timing["started"])
    print(f"oracle episodes, concurrency {c:3d}: {len(outs)} episodes in {dt:.1f}s = "
          f"{len(outs) / dt:.2f} episodes/s including {c} gateway starts "
          f"({timing['started'] - t:.1f}s), {steady:.2f} episodes/s once all are up; passed {ok}/{len(outs)}; episode p50 {_pct(ep, .5):.2f}s "
          f"p90 {_pct(ep, .9):.2f}s")


if __name__ == "__main__":
  main()
