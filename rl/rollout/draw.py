"""Rollouts: the policy served to the agent pool, episodes run with progress, and one step's
draw of groups (with dynamic sampling).

    with served_policy(config, params, version) as (server, cfg, pool):
      results, m = draw_rollouts(pool, stream, cfg, step)   # prompts_per_step x samples_per_prompt
      server.update_weights(new_params, version + 1)        # the weight sync

Rollouts may be drawn ahead of the train step (rl/rollout/prefetch.py, loop.max_staleness).
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np

from envs import sandbox
from envs.harness.jetstream_client import jetstream_policy_factory
from envs.harness.pool import AgentPool
from rl import distributed
from rl import plan
from rl.batch import informative_groups
from rl.batch import pick_groups
from rl.metrics import progress_bar
from rl.rollout import capacity
from rl.rollout.published_weights import WeightPublisher
from rl.rollout.serve import build_server
from rl.task_data import make_episodes

# Added to every episode seed of RL step s: 104729 * (s + 1); held-out evals use 7919 * (s + 1).
DRAW_SEED_STRIDE = 104729


_isolation_reported = False


def report_isolation(config) -> None:
  """Prints the code-execution sandbox's isolation level, once per process (the gateways,
  one a world, start quietly)."""
  global _isolation_reported
  if not _isolation_reported:
    print(f"worlds: code_execution isolation {sandbox.isolation(config.envs.sandbox)}", flush=True)
    _isolation_reported = True


def run_pool(pool, episodes, config, desc: str):
  """`run_episodes` with a progress bar that moves with each finished episode; results in
  episode order. One call for the whole list, so the pool can keep each worker on one warm
  world."""
  report_isolation(config)
  passed = []
  with progress_bar(config, len(episodes), desc) as bar:
    def on_result(r):
      passed.append(r.passed)
      bar.update(1)
      bar.set_postfix(pass_rate=f"{np.mean(passed):.3f}", refresh=False)
    return run_episodes(pool, episodes, config, on_result)


def run_episodes(pool, episodes, config, on_result=None) -> list:
  """The results of `episodes`, in episode order. In a multi-process job each process runs the
  episodes of its share of the groups (`distributed.share`: contiguous, so no group straddles
  two processes) on its own agent pool and engine, and every process gets every result."""
  if jax.process_count() == 1:
    return pool.run(episodes, on_result=on_result)
  groups = list(dict.fromkeys(e.group_id for e in episodes))
  mine = set(groups[distributed.share(len(groups))])
  local = pool.run([e for e in episodes if e.group_id in mine], on_result=on_result)
  return distributed.gather(distributed.next_tag("episodes"), local,
                            float(config.distributed.exchange_timeout_s))


def engine_scalars(server) -> dict:
  """The in-process engine's prompt / prefill counters since it started (the prefix and turn
  caches' effect); {} for rollout servers in other jobs."""
  engine = getattr(server, "engine", None)
  if engine is None:
    return {}
  out = {"rollout/prompt_tokens": float(engine.prompt_tokens),
         "rollout/prefilled_tokens": float(engine.prefilled_tokens)}
  turns = engine.turn_cache_stats()
  if turns:
    out.update({"rollout/turns_kept": float(turns["kept"]), "rollout/turn_hits": float(turns["hits"]),
                "rollout/turn_stale": float(turns["stale"])})
  return out


@contextlib.contextmanager
def served_policy(config, params, version: int = 0):
  """Rollout servers serving `params` as `version` and an agent pool whose policy they are:
  yields (server, cfg, pool). `server.update_weights(params, version)` is the weight sync.

  By default the server is a JetStream server in this process (cfg = `config` with
  rollout.address pointing at it; it stops on exit). With rollout.servers, the servers are
  separate jobs (`launch.py --mode=serve` with the same rollout.weights_dir) and `server` is
  the publisher that hands them each version through that directory; they keep running."""
  cfg = config.copy_and_resolve_references()
  if config.rollout.servers:
    r = config.rollout
    server = WeightPublisher(r.weights_dir, tuple(r.servers), r.sync_timeout_s,
                             r.weights_keep, r.weights_poll_s)
    try:
      if version == 0:   # not resumed from a checkpoint
        server.require_empty()
      print(f"rollout servers {', '.join(r.servers)}: publishing weights version {version} "
            f"in {server.weights_dir}", flush=True)
      server.update_weights(params, version)
    except BaseException:
      server.stop()
      raise
  else:
    shared = capacity.sharing_devices(config, lambda: plan.train_step_bytes_per_device(config))
    server = build_server(shared, params=params, port=0,
                          initial_version=version)
    with cfg.unlocked():
      cfg.rollout.address = server.address
  try:
    with AgentPool.from_config(cfg, jetstream_policy_factory(cfg)) as pool:
      yield server, cfg, pool
  finally:
    server.stop()


def draw_rollouts(pool, stream, cfg, step: int) -> tuple[list, dict]:
  """One step's rollouts. With train.max_draws > 1 (dynamic sampling, as in DAPO), further draws
  of prompts_per_step tasks are rolled out while fewer than prompts_per_step groups carry
  signal; the batch is then `pick_groups` of all of them."""
  p, g = int(cfg.train.prompts_per_step), int(cfg.train.samples_per_prompt)
  max_draws = max(int(cfg.train.max_draws), 1)
  results, draws = [], 0
  while True:
    eps = make_episodes(stream.take(p), cfg, g, first_group=draws * p,
                        seed_offset=DRAW_SEED_STRIDE * (step + 1))
    results += run_episodes(pool, eps, cfg)
    draws += 1
    if max_draws == 1:
      return results, {"train/draws": 1.0}
    live = informative_groups(results, cfg)
    if len(live) >= p or draws >= max_draws:
      break
  return pick_groups(results, live, p), {"train/draws": float(draws),
                                         "train/informative_groups_drawn": float(len(live))}
