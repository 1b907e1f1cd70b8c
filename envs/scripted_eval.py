"""--mode=eval: run a scripted policy over a split and report Pass@1 and mean reward.

  python launch.py --mode=eval --config=configs/tiny_cpu.py --config.policy=oracle
      [--config.eval.split=train] [--config.eval.transport=local] [--config.eval.max_tasks=50]

Policies: `oracle` replays each task's oracle tool calls through the world's gateway and checks
that every fact it relies on appears in the tool output; `null` calls no tool and answers "".
With `harness.style=shell` the gateway serves the shell tools and the oracle's calls are their
shell translation (envs/tasks/shell_oracle.py).
`model` runs a served policy through the harness: `main` hands it to
envs/harness/harness_eval.py.

Episodes of one world share a gateway process and a working copy that is reset between
episodes; `eval.concurrency` episodes run at once (threads driving gateway processes).
Prints pass@1 and mean reward per domain, over all tasks with their bootstrap intervals and per
task family (envs/eval_summary.py), and the error counts. The last printed line is one JSON
object: pass_at_1, mean_reward, by_domain, errors.
"""
import collections
import concurrent.futures
import dataclasses
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback

from envs import eval_summary
from envs import tasks as tasks_lib
from envs import worlds
from envs.apps import gateway as gateway_lib
from envs.apps import shell_tools
from envs.apps import worldstate
from envs.harness import harness_eval
from envs.tasks import rubric
from envs.tasks import shell_oracle

POLICIES = ("oracle", "null", "model")


@dataclasses.dataclass
class EpisodeOutcome:
  task_id: str
  domain: str
  level: int
  reward: float
  passed: bool
  errors: list            # error kinds met in the episode ("tool:<kind>", "oracle_expectation", ...)
  tool_calls: int
  wall_s: float
  criteria: list          # [(description, passed)]
  detail: str = ""        # what went wrong first (tool name and the head of its output)

  @property
  def outcome(self) -> str:
    """The first error kind met in the episode, or "ok" (eval_summary's outcome counts)."""
    return self.errors[0] if self.errors else "ok"


def scripted_actions(task, policy: str, style: str = "mcp"):
  """(tool calls [(name, args, expect)], final answer) of a scripted policy for a task, in the
  tools of `style` (mcp: the app tools; shell: bash, read, ...)."""
  if policy == "oracle":
    steps = (shell_oracle.shell_steps(task) if shell_tools.check_style(style) == "shell"
             else task.oracle_steps)
    return [(s["name"], s["args"], s.get("expect", [])) for s in steps], task.oracle_answer
  if policy == "null":
    return [], ""
  raise ValueError(f"no scripted policy {policy!r}")


def _expect_ok(text: str, exp: dict, envs_cfg) -> bool:
  if "number" in exp:
    return rubric.number_matches(text, exp["number"], exp.get("decimals", 6), 1e-9, 10 ** 9)
  return exp["text"].lower() in text.lower()


def run_episode(task, gw, inst: worldstate.WorldInstance, envs_cfg, policy: str,
                style: str = "mcp") -> EpisodeOutcome:
  """One episode of a scripted policy on an open gateway (of tool style `style`) whose world is
  `inst`."""
  t0 = time.monotonic()
  inst.reset(task.input_files)
  errors, detail = [], ""
  steps, answer = scripted_actions(task, policy, style)
  for name, args, expect in steps:
    r = gw.call_tool(name, args, timeout=envs_cfg.client_timeout_s)
    if r.is_error:
      errors.append(f"tool:{r.error_kind}")
    elif name in ("code_execution_run_python", "bash") and not r.text.startswith("status: ok"):
      # e.g. "status: timeout": the sandbox stopped the run; name the limit, not the oracle.
      errors.append("sandbox:" + r.text.split()[1])
    elif any(not _expect_ok(r.text, e, envs_cfg) for e in expect):
      errors.append("oracle_expectation")
    else:
      continue
    detail = detail or f"{name}: {r.text[:300]}"
  try:
    g = rubric.grade(task, answer, inst.pristine, inst.path, envs_cfg)
  except Exception:  # a grading bug must show up as an error, not end the run
    traceback.print_exc()
    errors.append("grade_error")
    g = rubric.GradeResult(0.0, False, [])
  return EpisodeOutcome(task.id, task.domain, task.level, g.reward, g.passed, errors, len(steps),
                        time.monotonic() - t0, [(r.description, r.passed) for r in g.results],
                        detail)


def _chunks(task_list, envs_cfg, concurrency):
  """Work units: tasks of one world, split so that there are at least `concurrency` units."""
  by_world = collections.OrderedDict()
  for t in task_list:
    by_world.setdefault(t.world_id, []).append(t)
  units = [list(v) for v in by_world.values()]
  while len(units) < concurrency and max(len(u) for u in units) > 1:
    units.sort(key=len, reverse=True)
    big = units.pop(0)
    units += [big[:len(big) // 2], big[len(big) // 2:]]
  return units


def run_tasks(task_list, envs_cfg, policy: str, transport: str, concurrency: int,
              worlds_root: str, work_root: str = None, timing: dict = None,
              style: str = "mcp") -> list:
  """Runs scripted episodes through the tools of `style` (mcp | shell); returns
  [EpisodeOutcome] in task order.

  With `timing` (a dict), every stream waits until all gateways have started, and
  timing["started"] / timing["done"] get the monotonic times of that moment and of the end:
  episode throughput without gateway start-up.
  """
  if transport not in ("mcp", "local"):
    raise ValueError(f"eval.transport must be mcp or local, got {transport!r}")
  shell_tools.check_style(style)
  own_tmp = work_root is None
  work_root = work_root or tempfile.mkdtemp(prefix="worlds_work_")

  units = _chunks(task_list, envs_cfg, concurrency)
  barrier = threading.Barrier(min(len(units), max(1, concurrency))) if timing is not None else None

  def unit_fn(args):
    ui, unit = args
    wid = unit[0].world_id
    inst = worldstate.WorldInstance(worlds.world_dir(worlds_root, wid),
                                    os.path.join(work_root, f"{wid}_{ui}"))
    out = []
    try:
      try:
        gw = (gateway_lib.Gateway(inst.path, envs_cfg, style) if transport == "mcp"
              else gateway_lib.LocalGateway(inst.path, envs_cfg, style))
      except Exception as e:  # noqa: BLE001 - every start failure is counted, not raised
        print(f"gateway start failed for {wid}: {type(e).__name__}: {e}", file=sys.stderr)
        if barrier is not None:
          barrier.abort()
        return [EpisodeOutcome(t.id, t.domain, t.level, 0.0, False, ["gateway_start"], 0, 0.0, [])
                for t in unit]
      with gw:
        if barrier is not None and ui < barrier.parties:
          try:
            if barrier.wait() == 0:
              timing["started"] = time.monotonic()
          except threading.BrokenBarrierError:  # another stream failed to start
            pass
        for t in unit:
          try:
            out.append(run_episode(t, gw, inst, envs_cfg, policy, style))
          except Exception:  # noqa: BLE001
            traceback.print_exc()
            out.append(EpisodeOutcome(t.id, t.domain, t.level, 0.0, False, ["episode_exception"],
                                      0, 0.0, []))
    finally:
      inst.close()
    return out

  try:
    with concurrent.futures.ThreadPoolExecutor(max(1, concurrency)) as ex:
      results = [o for outs in ex.map(unit_fn, enumerate(units)) for o in outs]
    if timing is not None:
      timing["done"] = time.monotonic()
  finally:
    if own_tmp:
      shutil.rmtree(work_root, ignore_errors=True)
  order = {t.id: i for i, t in enumerate(task_list)}
  return sorted(results, key=lambda o: order[o.task_id])


def error_counts(outcomes: list) -> dict:
  """Error kind -> how often the outcomes name it."""
  return dict(collections.Counter(e for o in outcomes for e in o.errors))


def main(config, flags=None, split=None):
  """Args: split, for a job of several processes (rl.distributed.work_split): items -> (this
  process's block, collect), where collect(results) returns every process's results in item
  order; None = every task here."""
  policy = config.policy
  if policy not in POLICIES:
    raise ValueError(f"config.policy must be one of {POLICIES}, got {policy!r}")
  # Tasks read from envs.tasks_file run through the harness whatever the policy (the scripted
  # eval below knows only the generated worlds).
  if policy == "model" or config.envs.tasks_file:
    return harness_eval.main(config, flags, split)
  style = shell_tools.check_style(config.harness.style)
  envs_cfg = config.envs
  t0 = time.monotonic()
  root = worlds.ensure_worlds(envs_cfg)
  t_gen = time.monotonic() - t0
  task_list = tasks_lib.load_split(envs_cfg, config.eval.split)
  if config.eval.max_tasks:
    task_list = task_list[:config.eval.max_tasks]
  mine, collect = split(task_list) if split is not None else (task_list, list)
  print(f"worlds ready in {root} ({t_gen:.1f}s); split={config.eval.split} tasks={len(task_list)} "
        f"({len(mine)} in this process) policy={policy} tools={style} "
        f"transport={config.eval.transport} concurrency={config.eval.concurrency}", flush=True)
  t1 = time.monotonic()
  outcomes = collect(run_tasks(mine, envs_cfg, policy, config.eval.transport,
                               config.eval.concurrency, root, style=style))
  dt = time.monotonic() - t1
  s = eval_summary.summarize(outcomes, task_list, config.loop.bootstrap, config.seed,
                             domain_of=lambda o: o.domain, errors=error_counts(outcomes))
  for line in eval_summary.format_eval(f"{config.eval.split} split", s, dt):
    print(line)
  print("errors: " + (", ".join(f"{k}={v}" for k, v in sorted(s["errors"].items())) or "none"))
  print(eval_summary.eval_json(s), flush=True)
  return s
