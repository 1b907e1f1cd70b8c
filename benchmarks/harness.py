"""Harness overhead and throughput, side by side with the scripted evaluator.

  python benchmarks/harness.py [--tasks 64] [--concurrency 1,8,32] [--worlds in00,co00]

Figures:
  1. Per-turn harness overhead, model time excluded: the token path alone (parse the sampled
     ids, build the observation ids, append to the trajectory) in a tight loop, and the
     `harness` share of real episodes' wall time (total minus model, tool, world start,
     grading and close) divided by their turns.
  2. Episodes/s of the token-level oracle through the harness (one agent-loop process per
     concurrent episode, real MCP gateways, grading) at each concurrency, beside the peer:
     envs.scripted_eval's scripted oracle (threads calling the same gateways with no tokens, no
     process per episode). The ratio is what token accounting and process isolation cost.
Pool start (spawning the agent-loop processes) is timed apart; world and gateway starts are
inside both figures. Prints figures; asserts nothing.
"""
import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import tiny_cpu  # noqa: E402
from envs import tasks as tasks_lib  # noqa: E402
from envs import worlds  # noqa: E402
from envs.chat import ChatFormat  # noqa: E402
from envs.chat import load_tokenizer  # noqa: E402
from envs.chat import template as T  # noqa: E402
from envs.harness.collate import batch_metrics  # noqa: E402
from envs.harness.oracle import oracle_factory  # noqa: E402
from envs.harness.pool import AgentPool  # noqa: E402
from envs.harness.trajectory import Trajectory  # noqa: E402
from envs.harness.episodes import task_episodes  # noqa: E402

from envs import scripted_eval  # noqa: E402


def token_path_per_turn(fmt, n_turns=2000):
  """Seconds per turn of the harness's own token work on a realistic tool turn."""
  call = T.assistant_text("", [{"name": "spreadsheets_read_sheet", "arguments": {
      "path": "/models/ember_foods_financial_model.xlsx", "sheet": "Financials"}}],
      "I need the revenue figure from the financial model.")
  sampled = fmt.tok.encode(call) + [fmt.sp.im_end]
  result = "\n".join(f"Row {i}: Revenue FY202{i % 5} 2,508.{i} EBITDA 412.{i}" for i in range(40))
  schemas = {"spreadsheets_read_sheet": {"type": "object", "properties": {
      "path": {"type": "string"}, "sheet": {"type": "string"}}, "required": ["path"]}}
  traj = Trajectory(fmt.prompt_ids([], "task"))
  t0, c0 = time.perf_counter(), time.process_time()
  for _ in range(n_turns):
    traj.append_sampled(sampled, [0.0] * len(sampled))
    turn = fmt.parse(sampled, schemas)
    assert turn.tool_calls
    traj.append_context(fmt.observation_ids(sampled, [result]))
    traj.ids()  # the next prompt, as the loop hands it to the policy
    if len(traj) > 50_000:
      traj = Trajectory(fmt.prompt_ids([], "task"))
  # CPU time too: on a shared host the wall figure mostly measures the neighbours.
  return (time.perf_counter() - t0) / n_turns, (time.process_time() - c0) / n_turns


def run_harness(c, tasks, conc):
  eps = task_episodes(tasks, c)
  t0 = time.monotonic()
  pool = AgentPool.from_config(c, oracle_factory([t.to_json() for t in tasks]), conc)
  start_s = time.monotonic() - t0
  try:
    t0 = time.monotonic()
    results = pool.run(eps)
    wall = time.monotonic() - t0
  finally:
    pool.close()
  return results, wall, start_s


def run_peer(c, tasks, conc, root):
  t0 = time.monotonic()
  outs = scripted_eval.run_tasks(tasks, c.envs, "oracle", "mcp", conc, root)
  return outs, time.monotonic() - t0


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tasks", type=int, default=64, help="episodes per concurrency level")
  p.add_argument("--concurrency", default="1,8,32")
  p.add_argument("--worlds", default="in00,co00", help="eval worlds to draw tasks from")
  p.add_argument("--worlds_root", default="", help="rendered worlds; default: a temp dir")
  args = p.parse_args()
  c = tiny_cpu.get_config()
  c.train.max_context = 16384
  c.harness.max_tokens_per_turn = 1024
  c.harness.max_turns = 20
  root = args.worlds_root or tempfile.mkdtemp(prefix="bench_worlds_")
  c.envs.worlds_root = root
  wids = args.worlds.split(",")
  specs = worlds.all_specs(c.envs)
  t0 = time.monotonic()
  for w in wids:
    if not os.path.isdir(worlds.world_dir(root, w)):
      worlds.generate_world(c.envs, specs[w], worlds.world_dir(root, w))
  print(f"rendered {len(wids)} worlds in {time.monotonic() - t0:.1f}s under {root}")
  pool_tasks = [t for t in tasks_lib.load_split(c.envs, "eval") if t.world_id in wids]
  # A fixed random sample: every level and family, the same list at each concurrency.
  tasks = random.Random(0).sample(pool_tasks, min(args.tasks, len(pool_tasks)))
  fmt = ChatFormat(load_tokenizer(c.tokenizer.path, c.tokenizer.special_ids),
                   c.tokenizer.thinking)
  wall, cpu = token_path_per_turn(fmt)
  load = os.getloadavg()[0]
  print(f"\n1. token path per turn (parse + observation ids + append + next prompt): "
        f"{wall * 1e6:.0f} us wall, {cpu * 1e6:.0f} us CPU (load average {load:.1f})")
  print(f"\n2. {len(tasks)} eval tasks (levels {sorted({t.level for t in tasks})}, "
        f"{len({t.family for t in tasks})} families), token-level oracle, real MCP gateways, "
        f"{os.cpu_count()} CPUs")
  print(f"{'conc':>5} {'harness ep/s':>13} {'peer ep/s':>10} {'ratio':>6} {'pass':>6} "
        f"{'pool start s':>13} {'harness ms/turn':>16} {'turns/ep':>9}")
  for conc in [int(x) for x in args.concurrency.split(",")]:
    results, wall, start_s = run_harness(c, tasks, conc)
    m = batch_metrics(results)
    turns = sum(r.turns for r in results)
    overhead = [r.timing.get("harness", 0.0) / max(r.turns, 1) for r in results]
    outs, peer_wall = run_peer(c, tasks, conc, root)
    peer_pass = sum(o.passed for o in outs) / len(outs)
    h_eps, p_eps = len(results) / wall, len(outs) / peer_wall
    print(f"{conc:>5} {h_eps:>13.2f} {p_eps:>10.2f} {h_eps / p_eps:>6.2f} "
          f"{m['pass_rate']:>6.0%} {start_s:>13.1f} "
          f"{statistics.median(overhead) * 1e3:>16.2f} {turns / len(results):>9.2f}"
          f"   (peer pass {peer_pass:.0%})")
    parts = {k: statistics.mean(r.timing.get(k, 0.0) for r in results)
             for k in ("world_start", "model", "tool", "grade", "close", "harness", "total")}
    print("      harness episode seconds (mean): " + ", ".join(
        f"{k} {v:.3f}" for k, v in parts.items()))
    non_ok = {k: v for k, v in m.items() if k.startswith("outcome/") and v and k != "outcome/ok"}
    if non_ok:
      print(f"      non-ok outcomes: {non_ok}")


if __name__ == "__main__":
  main()
