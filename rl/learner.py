"""The GRPO run behind `launch.py --mode=rl`: `rl_step` is one step of the algorithm, `run_rl`
the loop around it.

  run_rl    SFT warm start (trained unless saved) -> restore or start -> held-out eval before
            RL -> train.steps x rl_step (a held-out eval every loop.eval_every steps,
            checkpoints every checkpoint.save_every) -> held-out eval after RL ->
            runs/<name>/summary.json.
  rl_step   draw prompts -> roll out G episodes each through the agent pool against the served
            policy -> filter groups (masking, zero variance, dynamic sampling) -> batch
            (TrainExample) -> train step (advantages, policy loss, loss reduction, optimizer)
            -> weight sync to the rollout servers -> log.

Rollouts of step s come from weights at most loop.max_staleness versions old (0: the weights
step s trains; rl/rollout/prefetch.py). A killed run resumes from its newest checkpoint with the
same data position, so it continues as the uninterrupted run would.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from envs import eval_summary
from envs import judge as judge_lib
from envs import tasks as tasks_lib
from envs import worlds
from models import lora
from models import sharding
from rl import distributed
from rl import judge_server
from rl.batch import build_batch
from rl.batch import check_batch_shape
from rl.checkpoint import Checkpointer
from rl.evaluation import before_label
from rl.evaluation import evaluate
from rl.evaluation import evaluate_other_styles
from rl.evaluation import finish_summary
from rl.evaluation import print_before_after
from rl.lora_export import export_lora
from rl.metrics import Metrics
from rl.metrics import progress_bar
from rl.metrics import quiet_logs
from rl.params_io import start_fingerprint
from rl.run_files import sft_dir
from rl.run_files import starts_from_sft
from rl.run_files import run_dir
from rl.run_files import write_json
from rl.rollout import capacity
from rl.rollout.prefetch import RolloutPrefetcher
from rl.rollout.draw import draw_rollouts
from rl.rollout.draw import engine_scalars
from rl.rollout.draw import served_policy
from rl.sft import start_params
from rl.sft import warm_start
from rl.task_data import TaskStream
from rl.task_data import select_tasks
from rl.task_data import train_pool
from rl.train_step import TrainStep


@dataclasses.dataclass
class RLRun:
  """What the steps of one RL run share.

  Attributes:
    config: the run's config, with rollout.address resolved to the served policy.
    step_fn: the jitted train step (optimizer, shardings).
    server: the rollout server(s); `server.update_weights(params, version)` is the weight sync.
    pool: the agent pool that runs episodes against the server.
    stream: the train tasks in draw order; its position is checkpointed.
    metrics: metrics.jsonl / TensorBoard.
    served_version: the weights version the servers hold.
    prefetch: draws each step's rollouts (`draw`), up to loop.max_staleness steps ahead; made
      with the run (it draws nothing before the first `get`), closed by `train`.
  """
  config: Any
  step_fn: TrainStep
  server: Any
  pool: Any
  stream: TaskStream
  metrics: Metrics
  served_version: int = 0
  prefetch: RolloutPrefetcher = dataclasses.field(init=False)

  def __post_init__(self):
    self.prefetch = RolloutPrefetcher(lambda s: draw(self, s),
                                      int(self.config.loop.max_staleness),
                                      int(self.config.train.steps) - 1)


def draw(run: RLRun, step: int) -> tuple[list, dict, int]:
  """Draw prompts and roll them out (with dynamic sampling's extra draws): the episode
  results of `step`, their metrics, and the task stream's position after them."""
  t0, version = time.monotonic(), run.served_version
  results, m = draw_rollouts(run.pool, run.stream, run.config, step)
  m.update({"time/rollout_s": time.monotonic() - t0,
            "rollout/staleness": float(step - version)})
  return results, m, run.stream.position


def rl_step(run: RLRun, state: dict, step: int) -> tuple[dict, dict, int]:
  """One GRPO step: returns the new train state, the step's metrics and the data position
  after its batch."""
  t0 = time.monotonic()
  results, m_draw, data_position = run.prefetch.get(step)        # draw, roll out
  t_wait = time.monotonic() - t0
  example, m = build_batch(results, run.config, run.step_fn.batch_ways)  # filter, batch
  m.update(m_draw)
  # advantages, policy loss, loss reduction, optimizer update
  state, tm = run.step_fn(state, run.step_fn.shard_batch(example))
  jax.block_until_ready(state["params"])   # so the sync time below is the sync's alone
  t_sync = time.monotonic()
  # With LoRA the state's params, and so the sync, are the adapters alone.
  run.server.update_weights(distributed.host_copy(state["params"]), version=step + 1)  # sync
  run.served_version = step + 1
  t_sync = time.monotonic() - t_sync
  m["sync/bytes"] = float(lora.byte_count(state["params"]))
  m.update({k: float(v) for k, v in jax.device_get(tm).items() if np.ndim(v) == 0})
  m.update({"time/rollout_wait_s": t_wait, "time/weight_sync_s": t_sync,     # log
            "time/step_s": time.monotonic() - t0, "data/epoch": run.stream.epoch})
  # Each host's engine counts its own prompts and cache hits: the job's totals.
  m.update(distributed.summed(distributed.next_tag("engine"), engine_scalars(run.server),
                              float(run.config.distributed.exchange_timeout_s)))
  run.metrics.write(step + 1, "train", m)
  return state, m, data_position


def train(run: RLRun, state: dict, start_step: int, ckpt: Checkpointer, summary: dict,
          eval_tasks: list) -> dict:
  """rl_step from `start_step` to train.steps, with held-out evals every loop.eval_every
  steps (into `summary`) and checkpoints; returns the last state."""
  config, steps = run.config, int(run.config.train.steps)
  try:
    with progress_bar(config, steps, "rl") as bar:
      bar.update(start_step)
      for step in range(start_step, steps):
        state, m, data_position = rl_step(run, state, step)
        bar.set_postfix(reward=f"{m.get('mean_reward', 0):.3f}",
                        loss=f"{m.get('loss/total', 0):.3g}")
        bar.update(1)
        if config.loop.eval_every and (step + 1) % config.loop.eval_every == 0 \
           and step + 1 < steps:
          run.prefetch.drain()   # the eval needs the agent pool to itself
          s = evaluate(run.pool, config, eval_tasks, step + 1, f"step {step + 1}")
          run.metrics.write(step + 1, "eval", eval_summary.scalars(s))
          summary.setdefault("curve", []).append({"step": step + 1,
                                                  **eval_summary.scalars(s)})
        # The position after this step's batch: batches drawn ahead are drawn again on
        # resume (same tasks and seeds).
        ckpt.maybe_save(step + 1, state, {"data_position": data_position, "summary": summary,
                                          **base_meta(config)})
  finally:
    run.prefetch.close()
  return state


def base_meta(config) -> dict:
  """With LoRA, what the checkpoint's adapters apply to ({"lora_base": ...}: the SFT result and
  its start, or train.init_from's weights, or the seeded init); {} without."""
  if not config.lora.rank:
    return {}
  base = start_fingerprint(config)
  if starts_from_sft(config):
    base = f"SFT params in {sft_dir(config)}, trained from {base}"
  return {"lora_base": base}


def note_micro_batches(config, step_fn: TrainStep) -> None:
  """Says so where the step runs fewer micro-batches than train.micro_batches asks for."""
  rows = config.train.prompts_per_step * config.train.samples_per_prompt
  n = step_fn.micro_batches(rows // config.train.mini_batches)
  if n != config.train.micro_batches:
    print(f"train.micro_batches={config.train.micro_batches}: the step runs {n} micro-batches, "
          f"since {config.train.micro_batches} would give the {step_fn.batch_ways} devices that "
          "split a micro-batch's rows unequal shares", flush=True)


def place_base(config, step_fn: TrainStep) -> None:
  """LoRA: the frozen base into the step (`TrainStep.set_base`): the start params (the SFT
  result; train.init_from) or the seeded init."""
  params = start_params(config, step_fn.base_shardings)
  if params is None:
    step_fn.set_base(step_fn.init_base(jax.random.key(config.seed)))
  else:
    step_fn.set_base(params)


def restore_or_start(config, step_fn: TrainStep, ckpt: Checkpointer) -> tuple[int, dict, dict]:
  """(first step, train state, checkpoint meta): the newest checkpoint's, or step 0 from the
  start params (the SFT result, which `warm_start` trained before; train.init_from; the seeded
  init). With LoRA the state holds adapters (fresh: B = 0, the base's policy) and the base is
  placed first. Loads only: nothing is trained here."""
  if step_fn.lora is not None:
    place_base(config, step_fn)
  restored = ckpt.restore_latest(step_fn.abstract_state())
  if restored is not None:
    start_step, state, meta = restored
    saved, now = meta.get("lora_base"), base_meta(config).get("lora_base")
    if saved != now:
      raise ValueError(f"checkpoint step {start_step} in {ckpt.directory} holds adapters of the "
                       f"base {saved!r}, this config's base is {now!r}")
    print(f"resumed from checkpoint step {start_step} in {ckpt.directory}", flush=True)
    return start_step, state, meta
  if step_fn.lora is not None:
    return 0, step_fn.init_state(jax.random.key(config.seed)), {}
  params = start_params(config, step_fn.state_shardings["params"])
  state = step_fn.init_state(jax.random.key(config.seed))
  if params is not None:   # read with the state's shardings: global arrays on every process
    state = with_params(step_fn, state, params)
  return 0, state, {}


def run_rl(config, flags=None) -> dict:
  """The whole RL run; returns the summary written to runs/<name>/summary.json."""
  del flags
  t_start = time.monotonic()
  check_batch_shape(config)
  capacity.check_context(config)
  rdir = run_dir(config)
  os.makedirs(rdir, exist_ok=True)
  metrics = Metrics(rdir, config.loop.tensorboard)
  if tasks_lib.uses_generated_worlds(config.envs):  # tasks from files may bring their own
    worlds.ensure_worlds(config.envs)
  train_tasks = train_pool(config)
  eval_tasks = select_tasks(config, "eval", config.loop.eval_levels, config.loop.eval_max_tasks)
  if not config.envs.judge.checkpoint:  # else the judge served below fills the endpoint
    # Judge criteria without a judge: fail before SFT and rollouts, not at the first grade.
    judge_lib.require(train_tasks + eval_tasks, config.envs.judge)
  step_fn = TrainStep(config, sharding.make_mesh(config.mesh))
  note_micro_batches(config, step_fn)
  ckpt = Checkpointer.from_config(config)
  if step_fn.lora is not None or not ckpt.all_steps():  # a resumed full run needs no start
    warm_start(config, metrics)                         # SFT, when none is saved yet
  start_step, state, meta = restore_or_start(config, step_fn, ckpt)
  stream = TaskStream(train_tasks, config.seed, meta.get("data_position", 0))
  summary_path = os.path.join(rdir, "summary.json")
  summary = dict(meta.get("summary") or {})
  try:
    # The engine copies the weights device to device (rl/rollout/engine_weights.py, _place).
    # Graders reach a judge served from envs.judge.checkpoint through judged's config copy.
    # With LoRA an engine in this process starts from the base (then takes adapters); separate
    # servers load the base themselves (--mode=serve --weights) and are published adapters.
    in_process = step_fn.lora is not None and not config.rollout.servers
    served = step_fn.base if in_process else state["params"]
    with judge_server.judged(config) as judged_cfg, served_policy(
        judged_cfg, distributed.host_copy(served), start_step) as (server, cfg, pool):
      if in_process and start_step:   # resumed: the checkpoint's adapters
        server.update_weights(distributed.host_copy(state["params"]), version=start_step)
      if "before_rl" not in summary:
        s = evaluate(pool, cfg, eval_tasks, 0, "before RL")
        summary["before_rl"] = s
        metrics.write(start_step, "eval", eval_summary.scalars(s))
        evaluate_other_styles(pool, cfg, eval_tasks, 0, "before RL", summary, "before_rl")
        write_json(summary_path, finish_summary(summary, config, eval_tasks))
      print(eval_summary.format_summary(before_label(config), summary["before_rl"]), flush=True)
      run = RLRun(cfg, step_fn, server, pool, stream, metrics, served_version=start_step)
      state = train(run, state, start_step, ckpt, summary, eval_tasks)
      ckpt.wait()
      if step_fn.lora is not None and config.lora.export_dir:
        for what, path in export_lora(config, step_fn, state["params"]).items():
          print(f"LoRA export ({what}): {path}", flush=True)
      steps = int(config.train.steps)
      s = evaluate(pool, cfg, eval_tasks, steps, "after RL")
      summary["after_rl"] = s
      metrics.write(steps, "eval", eval_summary.scalars(s))
      evaluate_other_styles(pool, cfg, eval_tasks, steps, "after RL", summary, "after_rl")
  finally:
    metrics.close()
  ckpt.close()
  out = finish_summary(summary, config, eval_tasks)
  out["wall_s"] = round(time.monotonic() - t_start, 1)
  write_json(summary_path, out)
  print_before_after(out, config, summary_path)
  return out


def with_params(step_fn: TrainStep, state: dict, params) -> dict:
  """A fresh optimizer state around `params` (the SFT moments do not carry over); with the KL
  penalty on, `params` is the reference policy too."""
  with sharding.use_mesh(step_fn.mesh, step_fn.rules):
    return jax.jit(step_fn.state_around, out_shardings=step_fn.state_shardings)(
        params, jnp.zeros((), jnp.int32), state["rng"])


def main_rl(config, flags=None):
  quiet_logs()
  return run_rl(config, flags)
