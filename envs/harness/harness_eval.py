"""Evaluation through the harness: `--mode=eval --config.policy=model` lands here.

  python launch.py --mode=eval --config=configs/tiny_cpu.py --config.policy=model \
      [--config.eval.split=eval] [--config.eval.max_tasks=N] [--config.harness.num_workers=K]

Every episode runs in an agent-loop process of the pool, token-in/token-out, against the
task's world (MCP gateway) and is graded by its rubric. Policies:
  model   the Qwen3.5 policy: `harness.policy_backend` = jetstream (the token client,
          envs/harness/jetstream_client.py, talking to the server at rollout.address:
          `launch.py --mode=serve`) or local (in-process reference decode of config.model,
          random init);
  oracle  the token-level oracle (its tool calls written as Qwen3.5 text, tokenized);
  null    answers at once, calling no tool.
Prints pass@1 and mean reward per domain, over all tasks with their bootstrap intervals and per
task family (envs/eval_summary.py), the outcome and error taxonomy counts, and as its last line
one JSON object with keys pass_at_1, mean_reward, by_domain, errors.
"""
import functools
import time

from envs import eval_summary
from envs import judge as judge_lib
from envs import tasks as tasks_lib
from envs import worlds
from envs.harness import errors
from envs.harness.collate import batch_metrics
from envs.harness.episodes import task_episodes
from envs.harness.jetstream_client import TokenClient
from envs.harness.jetstream_client import jetstream_policy_factory
from envs.harness.jetstream_client import server_addresses
from envs.harness.oracle import oracle_factory
from envs.harness.policy import Action
from envs.harness.policy import ScriptedPolicy
from envs.harness.pool import AgentPool
from envs.tasks import task_file


class NullPolicy(ScriptedPolicy):
  """Answers nothing, at once."""

  def act(self, obs):
    return Action(reasoning="", content="")


def policy_factory(config, tasks):
  """The picklable `ChatFormat -> Policy` factory named by config.policy."""
  if config.policy == "oracle":
    return oracle_factory([t.to_json() for t in tasks], config.harness.style)
  if config.policy == "null":
    return functools.partial(NullPolicy)
  if config.policy == "model":
    backend = config.harness.policy_backend
    if backend == "local":
      # local_model imports JAX, which only this backend needs (not the scripted policies, not
      # a served model).
      from envs.harness.local_model import local_model_factory  # lazy: JAX, local backend only
      return local_model_factory(config)
    if backend == "jetstream":
      for address in server_addresses(config):
        probe = TokenClient(address)
        try:
          if not probe.health():
            raise SystemExit(
                f"no rollout server answers at {address}: start one with "
                "`launch.py --mode=serve` (same config), or set harness.policy_backend=local")
        finally:
          probe.close()
      return jetstream_policy_factory(config)
    raise ValueError(f"unknown harness.policy_backend {backend!r} (local | jetstream)")
  raise ValueError(f"unknown policy {config.policy!r} (model | oracle | null)")


def episode_domain(r) -> str:
  return r.meta.get("domain", "")


def error_counts(results) -> dict:
  """Error class (and judge errors) -> episodes, those that happened, from batch_metrics."""
  m = batch_metrics(results)
  return {c: int(m[f"errors/{c}"]) for c in errors.ERROR_CLASSES + (errors.JUDGE_ERROR,)
          if m[f"errors/{c}"]}


def main(config, flags=None, split=None):
  """Args: split, for a job of several processes (rl.distributed.work_split): items -> (this
  process's block, collect), where collect(results) returns every process's results in item
  order; None = every episode here."""
  del flags
  t0 = time.monotonic()
  tasks = tasks_lib.load_tasks(config.envs, config.eval.split)
  if config.eval.max_tasks:
    tasks = tasks[:config.eval.max_tasks]
  judge_lib.require(tasks, config.envs.judge)  # judge criteria need a judge, before any rollout
  factory = policy_factory(config, tasks)  # fails fast (no server) before rendering worlds
  # Tasks read from files may each bring their own world folder (Task.world_dir).
  root = (worlds.ensure_worlds(config.envs) if task_file.needs_generated_worlds(tasks)
          else config.envs.worlds_root)
  episodes = task_episodes(tasks, config, worlds_root=root)
  print(f"worlds ready in {root} ({time.monotonic() - t0:.1f}s); split={config.eval.split} "
        f"tasks={len(tasks)} policy={config.policy} through the harness, "
        f"{config.harness.num_workers} agent-loop processes", flush=True)
  t1 = time.monotonic()
  mine, collect = split(episodes) if split is not None else (episodes, list)
  with AgentPool.from_config(config, factory) as pool:
    results = collect(pool.run(mine))
    deaths = list(pool.deaths)
  dt = time.monotonic() - t1
  s = eval_summary.summarize(results, tasks, config.loop.bootstrap, config.seed,
                             domain_of=episode_domain, errors=error_counts(results),
                             outcome_order=errors.OUTCOMES)
  for line in eval_summary.format_eval(f"{config.eval.split} split", s, dt):
    print(line)
  print("outcomes: " + ", ".join(f"{k}={v}" for k, v in s["outcomes"].items()))
  print("errors: " + (", ".join(f"{k}={v}" for k, v in s["errors"].items()) or "none"))
  if deaths:
    print(f"agent processes lost and replaced: {len(deaths)}")
  print(eval_summary.eval_json(s), flush=True)
  return s
