"""Evaluation through the harness: `--mode=eval --config.policy=model` lands here.

  python launch.py --mode=eval --config=configs/tiny_cpu.py --config.policy=model \
      [--config.eval.split=eval] [--config.eval.max_tasks=N] [--config.harness.num_workers=K]

Every episode runs in an agent-loop process of the pool, token-in/token-out, against the
task's world (MCP gateway) and is graded by its rubric. Policies:
  model   the Qwen3.5 policy: `harness.policy_backend` = jetstream (the token client of
          rl/rollout, talking to the server at rollout.address: `launch.py --mode=serve`) or
          local (in-process reference decode of config.model, random init);
  oracle  the token-level oracle (its tool calls written as Qwen3.5 text, tokenized);
  null    answers at once, calling no tool.
Prints pass@1 and mean reward per domain, the error taxonomy counts, and as its last line
one JSON object with keys pass_at_1, mean_reward, by_domain, errors.
"""
import functools
import json
import time

from envs.evaluate import pass_and_reward
from envs.harness import errors as E
from envs.harness.batch import batch_metrics
from envs.harness.policy import Action
from envs.harness.policy import ScriptedPolicy
from envs.harness.pool import AgentPool


class NullPolicy(ScriptedPolicy):
  """Answers nothing, at once."""

  def act(self, obs):
    return Action(reasoning="", content="")


def policy_factory(config, tasks):
  """The picklable `ChatFormat -> Policy` factory named by config.policy."""
  if config.policy == "oracle":
    from envs.harness.oracle import oracle_factory
    return oracle_factory([t.to_json() for t in tasks])
  if config.policy == "null":
    return functools.partial(NullPolicy)
  if config.policy == "model":
    backend = config.harness.policy_backend
    if backend == "local":
      from envs.harness.local_model import local_model_factory
      return local_model_factory(config)
    if backend == "jetstream":
      from rl.rollout.client import TokenClient
      from rl.rollout.client import jetstream_policy_factory
      from rl.rollout.client import server_addresses
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


def summarize(results) -> dict:
  """pass@1 and mean reward, overall and per domain, and the taxonomy counts."""
  m = batch_metrics(results)
  errors = {c: int(m[f"errors/{c}"]) for c in E.ERROR_CLASSES if m[f"errors/{c}"]}
  return dict(pass_and_reward(results, lambda r: r.meta.get("domain", "")), errors=errors,
              outcomes={o: int(m[f"outcome/{o}"]) for o in E.OUTCOMES if m[f"outcome/{o}"]})


def main(config, flags=None):
  del flags
  from envs import tasks as tasks_lib
  from envs import worlds
  from envs.harness.worlds import task_episodes
  t0 = time.monotonic()
  tasks = tasks_lib.load_split(config.envs, config.eval.split)
  if config.eval.max_tasks:
    tasks = tasks[:config.eval.max_tasks]
  factory = policy_factory(config, tasks)  # fails fast (no server) before rendering worlds
  root = worlds.ensure_worlds(config.envs)
  episodes = task_episodes(tasks, config, worlds_root=root)
  print(f"worlds ready in {root} ({time.monotonic() - t0:.1f}s); split={config.eval.split} "
        f"tasks={len(tasks)} policy={config.policy} through the harness, "
        f"{config.harness.num_workers} agent-loop processes", flush=True)
  t1 = time.monotonic()
  with AgentPool.from_config(config, factory) as pool:
    results = pool.run(episodes)
    deaths = list(pool.deaths)
  dt = time.monotonic() - t1
  s = summarize(results)
  for d, v in s["by_domain"].items():
    print(f"{d:24s} n={v['n']:4d}  pass@1={v['pass_at_1']:.4f}  mean_reward={v['mean_reward']:.4f}")
  print(f"{'all':24s} n={s['n']:4d}  pass@1={s['pass_at_1']:.4f}  "
        f"mean_reward={s['mean_reward']:.4f}  ({dt:.1f}s, {len(results) / max(dt, 1e-9):.2f} "
        "episodes/s)")
  print("outcomes: " + ", ".join(f"{k}={v}" for k, v in s["outcomes"].items()))
  print("errors: " + (", ".join(f"{k}={v}" for k, v in s["errors"].items()) or "none"))
  if deaths:
    print(f"agent processes lost and replaced: {len(deaths)}")
  print(json.dumps(dict(pass_at_1=s["pass_at_1"], mean_reward=s["mean_reward"],
                        by_domain=s["by_domain"], errors=s["errors"])), flush=True)
  return s
