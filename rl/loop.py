"""The training loops behind `launch.py --mode=sft` and `--mode=rl`.

  SFT warm start   oracle episodes of the train split through the real harness (worlds, MCP
                   gateways, chat format) -> padded batches -> cross-entropy on the sampled
                   (assistant) tokens only -> params checkpointed (orbax) under runs/<name>/sft.
  RL (GRPO)        a JetStream rollout server in this process holds the policy; an agent pool
                   (one process per agent loop) runs G episodes per task against it through
                   the token-in/token-out client; rewards, group masking, one train step,
                   weight sync to the server; checkpoints of the whole state plus the data
                   position, so a killed run resumes where its last checkpoint left it.
  Held-out eval    pass@1 and mean reward on the eval split (levels and size from
                   config.loop), with 95% bootstrap intervals over tasks, before RL (after SFT)
                   and after RL; written to runs/<name>/summary.json.

Metrics go to runs/<name>/metrics.jsonl and TensorBoard (runs/<name>/tb); the console shows
progress bars with ETA. Everything is synchronous: rollouts of step k use the params of step k.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np


# ----------------------------------------------------------------------------- worlds


@dataclasses.dataclass(frozen=True)
class ToolSubsetSpec:
  """A world spec whose started world shows only `tools` (all when empty).

  The small setups have no use for most of the 24 tools, and each one costs a few hundred
  tokens of system prompt in every trajectory; a call to a hidden tool is an unknown-tool
  error like any other. `schema="compact"` also shortens each tool's JSON to its name and
  required parameters with their types (see `compact_tool`). Picklable, so it travels to the
  agent processes.
  """
  inner: Any
  tools: tuple = ()
  schema: str = "full"

  def start(self):
    world = self.inner.start()
    if not self.tools and self.schema == "full":
      return world
    return _ToolSubsetWorld(world, self.tools, self.schema)


TOOL_SCHEMAS = ("full", "compact")


def compact_tool(tool: dict) -> dict:
  """A tool's JSON cut to what a call needs: name, required parameters and their types.

  Descriptions, titles, defaults and optional parameters go: for a model trained on the
  environment's own demonstrations they are ~100 tokens a tool of fixed text in every
  trajectory. The result is still a valid function schema of the same call format.
  """
  fn = tool.get("function", tool)
  params = fn.get("parameters") or {}
  required = list(params.get("required") or [])
  props = params.get("properties") or {}
  return {"type": "function", "function": {
      "name": fn["name"],
      "parameters": {"type": "object",
                     "properties": {k: {"type": props.get(k, {}).get("type", "string")}
                                    for k in required},
                     "required": required}}}


class _ToolSubsetWorld:

  def __init__(self, world, names, schema: str = "full"):
    if schema not in TOOL_SCHEMAS:
      raise ValueError(f"config.loop.tool_schema={schema!r}; expected one of {TOOL_SCHEMAS}")
    self._w, self._names, self._schema = world, set(names), schema

  def tools(self):
    out = self._w.tools()
    if self._names:
      out = [t for t in out if t.get("function", t)["name"] in self._names]
      missing = self._names - {t.get("function", t)["name"] for t in out}
      if missing:
        raise ValueError(f"config.loop.tools names tools this world does not have: "
                         f"{sorted(missing)}")
    return [compact_tool(t) for t in out] if self._schema == "compact" else out

  def call_tool(self, name, arguments):
    return self._w.call_tool(name, arguments)

  def grade(self, final_answer):
    return self._w.grade(final_answer)

  def close(self, reuse: bool = False):
    return self._w.close(reuse=reuse)


def select_tasks(config, split: str, levels: Sequence[int], max_tasks: int = 0,
                 families: Sequence[str] = ()) -> list:
  """The tasks of `split` whose level is in `levels` (and family in `families`, when given), in
  the split's fixed order."""
  from envs import tasks as tasks_lib
  out = [t for t in tasks_lib.load_split(config.envs, split) if t.level in tuple(levels)]
  if families:
    known = sorted({t.family for t in out})
    unknown = sorted(set(families) - set(known))
    if unknown:
      raise ValueError(f"loop.families names {unknown}, not task families of the {split} split "
                       f"at levels {tuple(levels)}; they are {known}")
    out = [t for t in out if t.family in tuple(families)]
  return out[:max_tasks] if max_tasks else out


def read_pass_rates(path: str) -> dict:
  """task id -> measured pass rate, from the JSON --mode=pass_rates writes."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"loop.train_pass_rates={path!r} is not a file (--mode=pass_rates "
                            "writes one)")
  with open(path, encoding="utf-8") as f:
    try:
      d = json.load(f)
      return {str(k): float(v) for k, v in d["pass_rate"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise ValueError(f"loop.train_pass_rates={path!r} is not a pass-rate file of "
                       f"--mode=pass_rates ({type(e).__name__}: {e})") from e


def train_pool(config) -> list:
  """The train tasks RL samples from: loop.levels and loop.families of the train split, then,
  with loop.train_pass_range = (lo, hi), only the tasks whose pass rate measured under the
  starting policy (loop.train_pass_rates) lies in [lo, hi]. Tasks the policy always or never
  passes give groups without signal; dropping them beforehand (offline difficulty filtering)
  puts a step's rollouts on tasks that teach. Tasks the file does not rate are dropped too."""
  tasks = select_tasks(config, "train", config.loop.levels, families=tuple(config.loop.families))
  rng = tuple(config.loop.train_pass_range)
  if not rng:
    return tasks
  if len(rng) != 2 or not 0.0 <= float(rng[0]) <= float(rng[1]) <= 1.0:
    raise ValueError(f"loop.train_pass_range must be () or (lo, hi) with 0 <= lo <= hi <= 1, "
                     f"got {rng}")
  if not config.loop.train_pass_rates:
    raise ValueError("loop.train_pass_range is set but loop.train_pass_rates names no file")
  rates = read_pass_rates(config.loop.train_pass_rates)
  lo, hi = float(rng[0]), float(rng[1])
  kept = [t for t in tasks if t.id in rates and lo <= rates[t.id] <= hi]
  rated = sum(t.id in rates for t in tasks)
  if not kept:
    raise ValueError(f"no train task has a measured pass rate in [{lo}, {hi}] "
                     f"({rated} of {len(tasks)} rated in {config.loop.train_pass_rates})")
  print(f"train pool: {len(kept)} of {len(tasks)} train tasks ({rated} rated) with a measured "
        f"pass rate in [{lo:g}, {hi:g}]", flush=True)
  return kept


def make_episodes(tasks, config, samples_per_task: int = 1, first_group: int = 0,
                  seed_offset: int = 0, temperature: Optional[float] = None) -> list:
  """Harness episodes for `tasks` (one group per task), worlds restricted to loop.tools;
  `temperature` None = the loop's (rl.temperature)."""
  from envs.harness.worlds import task_episodes
  eps = task_episodes(tasks, config, samples_per_task, first_group,
                      worlds_root=config.envs.worlds_root)
  tools, schema = tuple(config.loop.tools), str(config.loop.tool_schema)
  return [dataclasses.replace(e, world=ToolSubsetSpec(e.world, tools, schema),
                              seed=e.seed + seed_offset, temperature=temperature) for e in eps]


# ----------------------------------------------------------------------------- statistics


def bootstrap_ci(per_task: np.ndarray, resamples: int, seed: int = 0, level: float = 0.95):
  """Percentile bootstrap interval of the mean over tasks (rows = tasks, resampled whole)."""
  x = np.asarray(per_task, np.float64)
  if x.size == 0:
    return [0.0, 0.0]
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(x), size=(resamples, len(x)))
  means = x[idx].mean(axis=1)
  a = (1.0 - level) / 2.0
  return [float(np.quantile(means, a)), float(np.quantile(means, 1.0 - a))]


def paired_bootstrap_delta(before: dict, after: dict, resamples: int, seed: int = 0,
                           level: float = 0.95):
  """Percentile bootstrap interval of mean(after - before) over the tasks both hold (task id ->
  pass rate). Both evals see the same tasks, and a task's outcome before predicts its outcome
  after (most tasks fail both or pass both), so resampling tasks as pairs gives the change a
  much narrower interval than the two separate intervals do."""
  ids = sorted(set(before) & set(after))
  return bootstrap_ci(np.array([after[i] - before[i] for i in ids]), resamples, seed, level)


def summarize_eval(results, tasks, resamples: int, seed: int = 0) -> dict:
  """pass@1 and mean reward over tasks (samples of a task averaged first), with 95% CIs."""
  by_task: dict[str, list] = {t.id: [] for t in tasks}
  for r in results:
    by_task.setdefault(r.task_id, []).append(r)
  rows = {tid: v for tid, v in by_task.items() if v}
  # Pass rate per task: the eval's unit, kept for the paired interval of a before/after change
  # (paired_bootstrap_delta) and broken down by family below.
  per_task_pass = {tid: float(np.mean([r.passed for r in v])) for tid, v in rows.items()}
  passed = np.array(list(per_task_pass.values()))
  reward = np.array([np.mean([r.reward for r in v]) for v in rows.values()])
  outcomes: dict[str, int] = {}
  for r in results:
    outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
  # pass@1 per task family: where the policy fails (a lookup it cannot do, a call it garbles).
  family = {t.id: getattr(t, "family", "") for t in tasks}
  fam_rows: dict[str, list] = {}
  for tid, p in per_task_pass.items():
    if family.get(tid):
      fam_rows.setdefault(family[tid], []).append(p)
  by_family = {f: {"n_tasks": len(v), "pass_at_1": float(np.mean(v))}
               for f, v in sorted(fam_rows.items())}
  return {"n_tasks": len(rows), "n_episodes": len(results),
          "pass_at_1": float(passed.mean()) if len(rows) else 0.0,
          "pass_at_1_ci95": bootstrap_ci(passed, resamples, seed),
          "mean_reward": float(reward.mean()) if len(rows) else 0.0,
          "mean_reward_ci95": bootstrap_ci(reward, resamples, seed + 1),
          "outcomes": outcomes, "by_family": by_family, "per_task_pass": per_task_pass}


# ----------------------------------------------------------------------------- logging


class Metrics:
  """JSONL (always) and TensorBoard (config.loop.tensorboard) under the run directory."""

  def __init__(self, run_dir: str, tensorboard: bool):
    os.makedirs(run_dir, exist_ok=True)
    self._f = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
      except ImportError:  # TensorBoard is optional; the JSONL has everything
        self._tb = None

  def write(self, step: int, phase: str, metrics: dict) -> None:
    flat = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0 and _is_num(v)}
    self._f.write(json.dumps({"step": int(step), "phase": phase, "time": time.time(), **flat})
                  + "\n")
    self._f.flush()
    if self._tb is not None:
      for k, v in flat.items():
        self._tb.add_scalar(f"{phase}/{k}", v, step)
      self._tb.flush()

  def close(self):
    self._f.close()
    if self._tb is not None:
      self._tb.close()


def _is_num(v) -> bool:
  try:
    float(v)
    return True
  except (TypeError, ValueError):
    return False


def _bar(config, total: int, desc: str):
  from tqdm import tqdm
  # Redirected to a file, a bar that redraws ten times a second fills it: every 30 s then.
  interval = 0.1 if sys.stderr.isatty() else 30.0
  return tqdm(total=total, desc=desc, disable=not config.loop.progress, dynamic_ncols=True,
              leave=True, mininterval=interval)


def run_dir(config) -> str:
  return os.path.join(config.workdir, config.name)


# ----------------------------------------------------------------------------- rollouts


_isolation_reported = False


def report_isolation(config) -> None:
  """Prints the code-execution sandbox's isolation level, once per process (the gateways,
  one a world, start quietly)."""
  global _isolation_reported
  if not _isolation_reported:
    from envs import sandbox
    print(f"worlds: code_execution isolation {sandbox.isolation(config.envs.sandbox)}", flush=True)
    _isolation_reported = True


def run_pool(pool, episodes, config, desc: str):
  """pool.run with a progress bar that moves with each finished episode; results in episode
  order. One call for the whole list, so the pool can keep each worker on one warm world."""
  report_isolation(config)
  passed = []
  with _bar(config, len(episodes), desc) as bar:
    def on_result(r):
      passed.append(r.passed)
      bar.update(1)
      bar.set_postfix(pass_rate=f"{np.mean(passed):.3f}", refresh=False)
    return pool.run(episodes, on_result=on_result)


def _engine_scalars(server) -> dict:
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
  from envs.harness.pool import AgentPool
  from rl.rollout.client import jetstream_policy_factory
  cfg = config.copy_and_resolve_references()
  if config.rollout.servers:
    from rl.rollout.published_weights import WeightPublisher
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
    from rl.rollout import capacity
    from rl.rollout.serve import build_server
    server = build_server(capacity.sharing_the_trainers_devices(config), params=params, port=0,
                          initial_version=version)
    with cfg.unlocked():
      cfg.rollout.address = server.address
  try:
    with AgentPool.from_config(cfg, jetstream_policy_factory(cfg)) as pool:
      yield server, cfg, pool
  finally:
    server.stop()


def collect_oracle(config, tasks) -> list:
  """The oracle's episodes on `tasks` through the real harness and worlds."""
  from envs.harness.oracle import oracle_factory
  from envs.harness.pool import AgentPool
  # The oracle's turns are as long as its plan needs, whatever limits the policy samples
  # under (a short max_tokens_per_turn or max_turns would cut the demonstrations).
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.harness.max_turns = max(config.harness.max_turns,
                                   max((len(t.oracle_steps) for t in tasks), default=0) + 1)
    config.harness.max_tokens_per_turn = max(config.harness.max_tokens_per_turn, 1024)
  eps = make_episodes(tasks, config)
  with AgentPool.from_config(config, oracle_factory([t.to_json() for t in tasks])) as pool:
    return run_pool(pool, eps, config, "oracle episodes")


# ----------------------------------------------------------------------------- SFT


def sft_loss(model_cfg, params, batch, lm_weight: float = 0.0):
  """Cross-entropy of the assistant (sampled) tokens, -sum(mask * logp) / sum(mask), plus
  `lm_weight` times the mean next-token loss over every token of the trajectories (system,
  prompt, tool results): the language-modelling signal that teaches a small model from scratch
  to read tool output, which the assistant tokens alone carry too little of."""
  import jax.numpy as jnp
  from rl.train_step import token_logprobs
  lp, _ = token_logprobs(model_cfg, params, batch["tokens"], 1.0)
  mask = batch["loss_mask"].astype(lp.dtype)
  loss = -(lp * mask).sum() / jnp.maximum(mask.sum(), 1.0)
  if lm_weight:
    pos = jnp.arange(lp.shape[1])[None, :]
    every = ((pos >= 1) & (pos < batch["lengths"][:, None])).astype(lp.dtype)
    loss = loss + lm_weight * -(lp * every).sum() / jnp.maximum(every.sum(), 1.0)
  return loss


def copy_drill_batch(rng, rows: int, length: int, low: int, high: int, row_len: int = 0) -> dict:
  """Synthetic copy rows: a segment x_1..x_n (x uniform in [low, high)) and, later in the same
  row, the segment again; loss on the second copy after its first token (which nothing
  predicts). Same keys as an SFT batch, so `sft_loss` scores it.

  With row_len <= 2n a row is `x x` and the copy always sits n tokens after the original: a
  model can then copy by relative position alone ("repeat the token n back"), which the tiny
  default learns in ~100 steps and which transfers to nothing (benchmarks/copy_drill.py). With
  a longer row_len the segment and its copy sit at random positions in random filler, so only
  copying by content (find the earlier occurrence of this token, emit what followed it) lowers
  the loss: the skill level-1 tasks need (a path from the prompt, a figure from a tool's output).
  """
  x = rng.integers(low, high, (rows, length))
  row_len = max(int(row_len), 2 * length)
  if row_len == 2 * length:
    tokens = np.concatenate([x, x], axis=1).astype(np.int32)
    starts = np.full((rows,), length)
  else:
    tokens = rng.integers(low, high, (rows, row_len)).astype(np.int32)
    src = rng.integers(0, row_len - 2 * length + 1, (rows,))
    starts = src + length + rng.integers(0, row_len - length - (src + length) + 1)
    for r in range(rows):
      tokens[r, src[r]:src[r] + length] = x[r]
      tokens[r, starts[r]:starts[r] + length] = x[r]
  pos = np.arange(row_len)[None, :]
  loss_mask = ((pos > starts[:, None]) & (pos < starts[:, None] + length)).astype(np.float32)
  return {"tokens": tokens, "loss_mask": loss_mask,
          "lengths": np.full((rows,), row_len, np.int32)}


def sft_optimizer(config):
  from rl.train_step import make_optimizer
  optim = config.optim.copy_and_resolve_references()
  with optim.unlocked():
    optim.name = "adamw"
    optim.trainable = ""  # SFT trains every weight
    optim.lr = config.sft.lr
    optim.warmup_steps = config.sft.warmup_steps
    optim.schedule = config.sft.schedule
    optim.min_lr_ratio = 0.1
    optim.decay_steps = 0
  return make_optimizer(optim, config.sft.steps)


def _bucket(n: int, multiple: int) -> int:
  return -(-int(n) // multiple) * multiple


def sft_eval_fn(model_cfg):
  """jitted (params, batch) -> per-row sums over assistant tokens: (-logp, tokens, argmax hits)."""
  import jax
  import jax.numpy as jnp
  from models import qwen3_5

  @jax.jit
  def fn(params, batch):
    hidden, _ = qwen3_5.forward_hidden(model_cfg, params, batch["tokens"])
    logits = qwen3_5.logits_from_hidden(model_cfg, params, hidden[:, :-1])
    targets = batch["tokens"][:, 1:]
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    hit = jnp.argmax(logits, -1) == targets
    m = batch["loss_mask"][:, 1:] > 0
    return (-(lp * m).sum(1), m.sum(1), (hit & m).sum(1))
  return fn


def sft_validate(eval_fn, params, data: dict, batch_size: int, multiple: int) -> dict:
  """Held-out teacher-forced figures on oracle trajectories: assistant-token loss and accuracy,
  and the share of trajectories whose every assistant token is the argmax (greedy-exact)."""
  nll, n, hits = [], [], []
  for i in range(0, len(data["tokens"]), batch_size):
    rows = slice(i, i + batch_size)
    t = _bucket(data["lengths"][rows].max(), multiple)
    a, b, c = eval_fn(params, {"tokens": data["tokens"][rows, :t],
                               "loss_mask": data["loss_mask"][rows, :t]})
    nll.append(np.asarray(a)); n.append(np.asarray(b)); hits.append(np.asarray(c))
  nll, n, hits = map(np.concatenate, (nll, n, hits))
  return {"val_loss": float(nll.sum() / max(n.sum(), 1)),
          "val_token_acc": float(hits.sum() / max(n.sum(), 1)),
          "val_greedy_exact": float(np.mean(hits == n))}


def length_grouped_batches(rows: np.ndarray, lengths: np.ndarray, batch_size: int,
                           rng: np.random.Generator, window: int = 16) -> list:
  """One epoch of batches: rows shuffled, then sorted by length inside windows of
  `window` batches, so a batch's rows have similar lengths and little padding; batch order
  shuffled. A short last batch is dropped (one more compiled shape for a few rows; they come
  back in the next epoch's shuffle)."""
  order = rng.permutation(rows)
  out = []
  span = batch_size * window
  for i in range(0, len(order), span):
    chunk = order[i:i + span]
    chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
    out.extend(chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)
               if j + batch_size <= len(chunk))
  rng.shuffle(out)
  return out


def sft_train(config, data: dict, params, metrics: Optional[Metrics] = None,
              val_data: Optional[dict] = None, on_save=None):
  """config.sft.steps AdamW steps of `sft_loss` over shuffled rows of `data`; returns params.

  Each batch is cut to its longest row rounded up to sft.pad_multiple tokens (a few compiled
  shapes instead of every batch padded to the longest trajectory of the data). With
  `val_data`, held-out figures are logged every sft.eval_every steps; `on_save(step, params)`
  runs every sft.save_every steps.
  """
  import jax
  import optax
  from models import qwen3_5
  model_cfg = qwen3_5.config_from_dict(config.model)
  opt = sft_optimizer(config)
  lm_weight = float(config.sft.lm_loss_weight)
  multiple = int(config.sft.pad_multiple) or data["tokens"].shape[1]
  drill_rows, drill_weight = int(config.sft.copy_drill_rows), float(config.sft.copy_drill_weight)
  drill_only = int(config.sft.copy_drill_only_steps)
  if drill_only and not drill_rows:
    raise ValueError(f"sft.copy_drill_only_steps={drill_only} needs sft.copy_drill_rows > 0")
  if drill_rows:
    from envs.chat.tokenizer import ordinary_id_range
    drill_ids = ordinary_id_range(config.tokenizer.special_ids, model_cfg.vocab_size)

  def total_loss(p, batch, drill):
    loss = sft_loss(model_cfg, p, batch, lm_weight)
    drill_loss = sft_loss(model_cfg, p, drill) if drill is not None else 0.0
    return loss + drill_weight * drill_loss, drill_loss

  def make_step(loss_fn):
    @jax.jit
    def step(params, opt_state, *batches):
      (loss, drill_loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batches)
      updates, opt_state = opt.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state, loss, optax.global_norm(grads),
              drill_loss)
    return step

  step = make_step(total_loss)
  # Drill rows alone: where a small model first forms the content-copy circuit (cheap steps).
  drill_step = make_step(lambda p, drill: (sft_loss(model_cfg, p, drill),) * 2)

  eval_fn = sft_eval_fn(model_cfg) if val_data is not None and config.sft.eval_every else None
  opt_state = opt.init(params)
  rows = np.flatnonzero(data["loss_mask"].sum(1) > 0)
  rng = np.random.default_rng(config.seed)
  drill_rng = np.random.default_rng([config.seed, 1])
  bs = min(int(config.sft.batch_size), len(rows))
  batches: list = []
  steps = int(config.sft.steps)
  with _bar(config, steps, "sft") as bar:
    for i in range(steps):
      if not batches:
        batches = length_grouped_batches(rows, data["lengths"], bs, rng)
      drill = (copy_drill_batch(drill_rng, drill_rows, int(config.sft.copy_drill_len), *drill_ids,
                                row_len=int(config.sft.copy_drill_row_len)) if drill_rows else None)
      if i < drill_only:
        params, opt_state, loss, gnorm, drill_loss = drill_step(params, opt_state, drill)
      else:
        take = batches.pop()
        t = min(_bucket(data["lengths"][take].max(), multiple), data["tokens"].shape[1])
        batch = {"tokens": data["tokens"][take, :t], "loss_mask": data["loss_mask"][take, :t],
                 "lengths": data["lengths"][take]}
        params, opt_state, loss, gnorm, drill_loss = step(params, opt_state, batch, drill)
      m = {}
      if i % max(int(config.train.log_every), 1) == 0 or i == steps - 1:
        m.update(loss=float(loss), grad_norm=float(gnorm))
        if drill_rows:
          m.update(copy_drill_loss=float(drill_loss))
        bar.set_postfix(loss=f"{m['loss']:.3f}")
      if eval_fn is not None and ((i + 1) % int(config.sft.eval_every) == 0 or i == steps - 1):
        m.update(sft_validate(eval_fn, params, val_data, bs, multiple))
        bar.write(f"sft step {i + 1}: " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()))
      if m and metrics is not None:
        metrics.write(i + 1, "sft", m)
      if on_save is not None and config.sft.save_every and (i + 1) % config.sft.save_every == 0:
        on_save(i + 1, params)
      bar.update(1)
  return params


def sft_dir(config) -> str:
  return config.sft.dir or os.path.join(run_dir(config), "sft")


def init_params(config, shardings=None):
  """The policy's starting weights: config.train.init_from (a Hugging Face directory, e.g. a
  Qwen3.5 release or the tiny base checkpoint) or, when that is empty, the seeded random init.
  With `shardings` (a Sharding per param) a checkpoint is read straight into those shards, each
  process reading only its own devices' blocks."""
  import jax
  from models import qwen3_5
  cfg = qwen3_5.config_from_dict(config.model)
  if not config.train.init_from:
    return qwen3_5.init_params(cfg, jax.random.key(config.seed))
  path = config.train.init_from
  if not os.path.isdir(path):
    raise FileNotFoundError(f"config.train.init_from={path!r} is not a directory")
  from models import hf_io
  loaded_cfg = hf_io.read_config(path, dtype=cfg.jnp_param_dtype)
  def shapes(model_cfg):
    return jax.tree.map(lambda x: (x.shape, x.dtype), jax.eval_shape(
        lambda: qwen3_5.init_params(model_cfg, jax.random.key(0))))
  if shapes(loaded_cfg) != shapes(cfg):
    raise ValueError(f"config.train.init_from={path!r} holds a model of another shape than "
                     f"config.model (checkpoint: hidden {loaded_cfg.hidden_size}, "
                     f"{loaded_cfg.num_hidden_layers} layers, vocab {loaded_cfg.vocab_size})")
  return qwen3_5.load_hf(path, dtype=cfg.jnp_param_dtype, shardings=shardings)[1]


def save_params(directory: str, params, meta: dict, step: int = 0) -> None:
  """Params under `directory` as checkpoint `step`; only the newest one is kept."""
  from rl.checkpoint import Checkpointer
  ck = Checkpointer(directory, save_every=1, keep=1, async_save=False)
  ck.save(step, {"params": params}, meta, force=True)
  ck.close()


def load_params(directory: str, config, shardings=None):
  """The params saved by `save_params`, or None when there are none (`load_params_and_meta`
  without the meta)."""
  return load_params_and_meta(directory, config, shardings)[0]


def load_params_and_meta(directory: str, config, shardings=None) -> tuple:
  """(params, meta) saved by `save_params`, or (None, None) when there are none.

  `shardings` (a Sharding per param, e.g. the train step's) places them on this run's devices;
  without it every param goes to this process's first device. A target with shardings is what lets a
  checkpoint written on other devices (a CPU run's SFT read on a GPU, another mesh) restore:
  orbax refuses a shardless target when the saved topology differs. A directory holding saves
  of which none restores is an error, not "no params": training anew would then fail to save
  over them, after spending the SFT.
  """
  import jax
  from rl.checkpoint import Checkpointer
  if not os.path.isdir(directory):
    return None, None
  from models import qwen3_5
  from models import sharding as shd
  cfg = qwen3_5.config_from_dict(config.model)
  shapes = jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0)))
  like = {"params": shd.with_shardings(shapes, shardings)}
  ck = Checkpointer(directory, save_every=1, keep=1, async_save=False)
  try:
    out = ck.restore_latest(like)
    if out is None and ck.skipped:
      step, err = ck.skipped[0]
      raise ValueError(f"{directory} holds saved params (step {step}) that do not restore "
                       f"into config.model: {err.splitlines()[0][:300]}. Move the directory "
                       f"away (or set config.sft.dir) to train anew.")
  finally:
    ck.close()
  return (None, None) if out is None else (out[1]["params"], out[2])


def start_fingerprint(config) -> str:
  """What an SFT run starts from: train.init_from's files (names, sizes, and the first and last
  MiB of each, so a release of many GB costs a few reads) or the seeded random init."""
  path = config.train.init_from
  if not path:
    return f"random-init-seed-{int(config.seed)}"
  if not os.path.isdir(path):
    raise FileNotFoundError(f"config.train.init_from={path!r} is not a directory")
  h = hashlib.sha256()
  for name in sorted(os.listdir(path)):
    f = os.path.join(path, name)
    if not os.path.isfile(f):
      continue
    size = os.path.getsize(f)
    h.update(f"{name}:{size};".encode())
    with open(f, "rb") as fh:
      h.update(fh.read(1 << 20))
      if size > 2 << 20:
        fh.seek(-(1 << 20), os.SEEK_END)
        h.update(fh.read())
  return h.hexdigest()[:16]


def run_sft(config, metrics: Optional[Metrics] = None):
  """Oracle data -> SFT from the random init -> params saved to runs/<name>/sft."""
  from envs import worlds
  from envs.harness.batch import collate
  t0 = time.monotonic()
  worlds.ensure_worlds(config.envs)
  tasks = select_tasks(config, "train", config.sft.levels, config.sft.max_tasks)
  print(f"SFT: {len(tasks)} oracle episodes (train split, levels {tuple(config.sft.levels)})",
        flush=True)
  results = collect_oracle(config, tasks)
  ok = [r for r in results if r.passed]
  if not ok:
    outcomes = sorted({f"{r.outcome}: {r.detail[:120]}" for r in results})[:5]
    raise SystemExit(f"SFT: none of {len(results)} oracle episodes passed, nothing to train "
                     f"on; outcomes: {outcomes}")
  data = collate(ok, config.harness.max_timeouts_per_group, pad_to=None)
  print(f"SFT: {len(ok)}/{len(results)} oracle episodes passed; rows of up to "
        f"{data['tokens'].shape[1]} tokens (mean {data['lengths'].mean():.0f}), "
        f"{int(data['loss_mask'].sum())} assistant tokens; {time.monotonic() - t0:.0f}s",
        flush=True)
  val = None
  if config.sft.eval_every and config.sft.eval_tasks:
    # Held-out figures on the eval split's oracle trajectories (teacher-forced; no sampling).
    pool = select_tasks(config, "eval", config.sft.levels)
    vt = pool[::max(1, len(pool) // int(config.sft.eval_tasks))][:int(config.sft.eval_tasks)]
    vres = [r for r in collect_oracle(config, vt) if r.passed]
    val = collate(vres, config.harness.max_timeouts_per_group, pad_to=None) if vres else None
  from models import qwen3_5
  model_cfg = qwen3_5.config_from_dict(config.model)

  # Recorded with the saves: a later run reuses them only if it starts from the same weights.
  start = start_fingerprint(config)

  def export(step, params):
    save_params(sft_dir(config), params, {"steps": int(step), "episodes": len(ok),
                                          "start": start}, step)
    if config.sft.export_hf:
      qwen3_5.save_hf(model_cfg, params, config.sft.export_hf)

  params = sft_train(config, data, init_params(config), metrics, val, export)
  steps, every = int(config.sft.steps), int(config.sft.save_every)
  if not (every and steps and steps % every == 0):  # else sft_train's last save was this one
    export(steps, params)
  if config.sft.export_hf:
    print(f"SFT: Hugging Face checkpoint in {config.sft.export_hf}", flush=True)
  print(f"SFT: done in {time.monotonic() - t0:.0f}s; params in {sft_dir(config)}", flush=True)
  return params


def _quiet_logs():
  """Orbax and JetStream log every save and request at INFO; the console is for the bars."""
  from absl import logging as absl_logging
  if absl_logging.get_verbosity() <= absl_logging.INFO:
    absl_logging.set_verbosity(absl_logging.WARNING)


def start_params(config, shardings=None, metrics: Optional[Metrics] = None):
  """The weights RL starts from: the SFT result (trained first when there is none yet and
  loop.sft_first asks for it), else config.train.init_from, else None (the seeded init)."""
  params = None
  if config.loop.sft_first and config.sft.steps:
    params, meta = load_params_and_meta(sft_dir(config), config, shardings)
    if params is None:
      params = run_sft(config, metrics)
    else:
      saved, now = (meta or {}).get("start"), start_fingerprint(config)
      if saved is not None and saved != now:
        # Reusing them would report an SFT start that is not this config's (e.g. after the
        # base checkpoint changed); nothing saved is removed.
        raise ValueError(
            f"{sft_dir(config)} holds SFT params trained from another start than "
            f"train.init_from={config.train.init_from!r} (saved from {saved}, now {now}): "
            f"move the directory away, or set config.sft.dir, to train anew")
      note = "" if saved else " (saved without a record of their start)"
      print(f"SFT params from {sft_dir(config)}{note}", flush=True)
  if params is None and config.train.init_from:
    params = init_params(config, shardings)
  return params


def main_sft(config, flags=None):
  del flags
  _quiet_logs()
  metrics = Metrics(run_dir(config), config.loop.tensorboard)
  try:
    run_sft(config, metrics)
  finally:
    metrics.close()


# ----------------------------------------------------------------------------- RL


class TaskStream:
  """Shuffled, epoch-aware task order from a grain IndexSampler; `position` is checkpointed."""

  def __init__(self, tasks, seed: int, position: int = 0):
    import grain.python as grain
    self.tasks = tasks
    self.sampler = grain.IndexSampler(num_records=len(tasks), num_epochs=None, shuffle=True,
                                      seed=seed, shard_options=grain.NoSharding())
    self.position = int(position)

  def take(self, n: int) -> list:
    out = [self.tasks[self.sampler[self.position + i].record_key] for i in range(n)]
    self.position += n
    return out

  @property
  def epoch(self) -> float:
    return self.position / len(self.tasks)


def row_length(config, longest: int) -> int:
  """The row length a step's batch pads to: the shortest of train.seq_buckets and
  train.seq_len that holds its longest trajectory."""
  from rl.train_step import row_lengths
  lengths = row_lengths(config.train)
  return next((n for n in lengths if n >= longest), lengths[-1])


def rl_batch(results, config) -> tuple[dict, dict]:
  """Episode results -> the train step's batch (fixed shape) and the rollout metrics."""
  from envs.harness.batch import batch_metrics
  from envs.harness.batch import collate
  from rl import grpo
  longest = max((len(r.tokens) for r in results), default=0)
  row_len = row_length(config, longest)
  d = collate(results, config.harness.max_timeouts_per_group, pad_to=row_len)
  batch = {"tokens": d["tokens"], "loss_mask": d["loss_mask"],
           "rollout_logprobs": d["rollout_logprobs"], "rewards": d["rewards"],
           "group_ids": d["group_ids"], "valid": d["train_mask"]}
  m = batch_metrics(results, config.harness.max_timeouts_per_group)
  live = grpo.live_rows(batch["rewards"], batch["group_ids"], batch["valid"],
                        batch["loss_mask"], config.rl.filter_zero_variance)
  m["train/live_rows"] = float(live.sum())
  m["train/row_len"], m["rollout/longest_tokens"] = float(row_len), float(longest)
  if int(config.train.mini_batches) == 1:
    # Rows of groups with no signal gathered into the last micro-batches, which the train step
    # then skips: with most groups all-pass or all-fail, most of the step's compute.
    batch = grpo.pack_live_rows(batch, live, int(config.train.micro_batches))
  return batch, m


def informative_groups(results, config) -> list[int]:
  """Group ids (in first-seen order) whose rows the train step learns from: the group masking
  and the zero-variance filter of `rl_batch`, applied to these results alone."""
  from envs.harness.batch import collate
  from rl import grpo
  d = collate(results, config.harness.max_timeouts_per_group)
  live = grpo.live_rows(d["rewards"], d["group_ids"], d["train_mask"], d["loss_mask"],
                        config.rl.filter_zero_variance)
  with_signal = {int(g) for g, l in zip(d["group_ids"], live) if l}
  return [g for g in dict.fromkeys(r.group_id for r in results) if g in with_signal]


def pick_groups(results, live: Sequence[int], n_groups: int) -> list:
  """Dynamic sampling's batch: the first `n_groups` groups with signal (`live`, in draw order:
  `informative_groups`), filled up with groups without signal when fewer have it (the step's
  batch keeps one shape), renumbered 0..n_groups-1."""
  order, with_signal = list(dict.fromkeys(r.group_id for r in results)), set(live)
  keep = (list(live) + [g for g in order if g not in with_signal])[:n_groups]
  if len(keep) < n_groups:
    raise ValueError(f"{len(order)} groups drawn, {n_groups} needed")
  new_id = {g: i for i, g in enumerate(keep)}
  by_group = {g: [r for r in results if r.group_id == g] for g in keep}
  return [dataclasses.replace(r, group_id=new_id[g]) for g in keep for r in by_group[g]]


def _draw_rollouts(pool, stream, cfg, step: int) -> tuple[list, dict]:
  """One step's rollouts. With train.max_draws > 1 (dynamic sampling, as in DAPO), further draws
  of prompts_per_step tasks are rolled out while fewer than prompts_per_step groups carry
  signal; the batch is then `pick_groups` of all of them."""
  p, g = int(cfg.train.prompts_per_step), int(cfg.train.samples_per_prompt)
  max_draws = max(int(cfg.train.max_draws), 1)
  results, draws = [], 0
  while True:
    eps = make_episodes(stream.take(p), cfg, g, first_group=draws * p,
                        seed_offset=104729 * (step + 1))
    results += pool.run(eps)
    draws += 1
    if max_draws == 1:
      return results, {"train/draws": 1.0}
    live = informative_groups(results, cfg)
    if len(live) >= p or draws >= max_draws:
      break
  return pick_groups(results, live, p), {"train/draws": float(draws),
                                         "train/informative_groups_drawn": float(len(live))}


def _evaluate(pool, config, tasks, step: int, tag: str) -> dict:
  eps = make_episodes(tasks, config, config.loop.eval_samples, seed_offset=7919 * (step + 1),
                      temperature=_eval_temperature(config))
  results = run_pool(pool, eps, config, f"eval {tag}")
  return summarize_eval(results, tasks, config.loop.bootstrap, config.seed)


def _eval_temperature(config) -> float:
  t = float(config.loop.eval_temperature)
  return float(config.rl.temperature) if t < 0 else t


def _fmt_eval(name: str, s: dict) -> str:
  lo, hi = s["pass_at_1_ci95"]
  rlo, rhi = s["mean_reward_ci95"]
  return (f"{name}: pass@1 {s['pass_at_1']:.3f} [95% CI {lo:.3f}, {hi:.3f}]  mean reward "
          f"{s['mean_reward']:.3f} [{rlo:.3f}, {rhi:.3f}]  ({s['n_tasks']} held-out tasks)")


def check_batch_shape(config) -> None:
  """The rollout batch must split into mini- and micro-batches and a training row must hold
  the longest trajectory the harness lets grow; said before any rollout."""
  if int(config.train.seq_len) < int(config.train.max_context):
    raise ValueError(
        f"train.seq_len={config.train.seq_len} < train.max_context={config.train.max_context}: "
        f"episodes may grow to train.max_context tokens but a training row holds "
        f"train.seq_len; raise train.seq_len (context parallelism, "
        f"models.sharding.context_parallel_rules, splits long rows over devices)")
  bad = [b for b in config.train.seq_buckets if not 0 < int(b) <= int(config.train.seq_len)]
  if bad:
    raise ValueError(f"train.seq_buckets {tuple(config.train.seq_buckets)}: {bad} not in "
                     f"(0, train.seq_len={config.train.seq_len}]")
  rows = int(config.train.prompts_per_step) * int(config.train.samples_per_prompt)
  parts = int(config.train.mini_batches) * int(config.train.micro_batches)
  if parts < 1 or rows % parts:
    raise ValueError(
        f"train.prompts_per_step x train.samples_per_prompt = {rows} rows do not split into "
        f"train.mini_batches x train.micro_batches = {config.train.mini_batches} x "
        f"{config.train.micro_batches}")


def run_rl(config, flags=None) -> dict:
  """The whole RL run; returns the summary written to runs/<name>/summary.json."""
  import jax
  from envs import worlds
  from models import sharding as shd
  from rl.checkpoint import Checkpointer
  from rl.rollout import capacity
  from rl.rollout_prefetch import RolloutPrefetcher
  from rl.train_step import TrainStep

  t_start = time.monotonic()
  check_batch_shape(config)
  capacity.check_context(config)
  rdir = run_dir(config)
  os.makedirs(rdir, exist_ok=True)
  metrics = Metrics(rdir, config.loop.tensorboard)
  worlds.ensure_worlds(config.envs)
  mesh = shd.make_mesh(config.mesh)
  step_fn = TrainStep(config, mesh)
  ckpt = Checkpointer.from_config(config)
  restored = ckpt.restore_latest(step_fn.abstract_state())
  meta: dict = {}
  if restored is not None:
    start_step, state, meta = restored
    print(f"resumed from checkpoint step {start_step} in {ckpt.directory}", flush=True)
  else:
    start_step = 0
    params = start_params(config, step_fn.state_shardings["params"], metrics)
    state = step_fn.init_state(jax.random.key(config.seed))
    if params is not None:
      state = _with_params(step_fn, state, params)

  train_tasks = train_pool(config)
  eval_tasks = select_tasks(config, "eval", config.loop.eval_levels, config.loop.eval_max_tasks)
  stream = TaskStream(train_tasks, config.seed, meta.get("data_position", 0))

  summary_path = os.path.join(rdir, "summary.json")
  summary = dict(meta.get("summary") or {})
  try:
    # The engine copies the weights device to device (rl/rollout/engine.py, _place).
    with served_policy(config, state["params"], start_step) as (server, cfg, pool):
      if "before_rl" not in summary:
        s = _evaluate(pool, cfg, eval_tasks, 0, "before RL")
        summary["before_rl"] = s
        metrics.write(start_step, "eval", _eval_scalars(s))
        _write_json(summary_path, _finish(summary, config, eval_tasks))
      print(_fmt_eval(_before_label(config), summary["before_rl"]), flush=True)
      steps = int(config.train.steps)
      served = [start_step]   # the weights version the servers hold

      def draw(step):
        t0, version = time.monotonic(), served[0]
        results, m = _draw_rollouts(pool, stream, cfg, step)
        m.update({"time/rollout_s": time.monotonic() - t0,
                  "rollout/staleness": float(step - version)})
        return results, m, stream.position

      prefetch = RolloutPrefetcher(draw, int(config.loop.max_staleness), steps - 1)
      try:
        with _bar(config, steps, "rl") as bar:
          bar.update(start_step)
          for step in range(start_step, steps):
            t0 = time.monotonic()
            results, m_draw, data_position = prefetch.get(step)
            t_wait = time.monotonic() - t0
            batch, m = rl_batch(results, cfg)
            m.update(m_draw)
            state, tm = step_fn(state, step_fn.shard_batch(batch))
            jax.block_until_ready(state["params"])   # so the sync time below is the sync's alone
            t_sync = time.monotonic()
            server.update_weights(state["params"], version=step + 1)
            served[0] = step + 1
            t_sync = time.monotonic() - t_sync
            tm = {k: float(v) for k, v in jax.device_get(tm).items() if np.ndim(v) == 0}
            m.update(tm)
            m.update({"time/rollout_wait_s": t_wait, "time/weight_sync_s": t_sync,
                      "time/step_s": time.monotonic() - t0, "data/epoch": stream.epoch})
            m.update(_engine_scalars(server))
            metrics.write(step + 1, "train", m)
            bar.set_postfix(reward=f"{m.get('mean_reward', 0):.3f}",
                            loss=f"{tm.get('loss/total', 0):.3g}")
            bar.update(1)
            if config.loop.eval_every and (step + 1) % config.loop.eval_every == 0 \
               and step + 1 < steps:
              prefetch.drain()   # the eval needs the agent pool to itself
              s = _evaluate(pool, cfg, eval_tasks, step + 1, f"step {step + 1}")
              metrics.write(step + 1, "eval", _eval_scalars(s))
              summary.setdefault("curve", []).append({"step": step + 1, **_eval_scalars(s)})
            # The position after this step's batch: batches drawn ahead are drawn again on
            # resume (same tasks and seeds).
            ckpt.maybe_save(step + 1, state, {"data_position": data_position,
                                              "summary": summary})
      finally:
        prefetch.close()
      ckpt.wait()
      s = _evaluate(pool, cfg, eval_tasks, steps, "after RL")
      summary["after_rl"] = s
      metrics.write(steps, "eval", _eval_scalars(s))
  finally:
    metrics.close()
  ckpt.close()
  out = _finish(summary, config, eval_tasks)
  out["wall_s"] = round(time.monotonic() - t_start, 1)
  _write_json(summary_path, out)
  print(_fmt_eval(_before_label(config), out["before_rl"]), flush=True)
  print(_fmt_eval("after RL", out["after_rl"]), flush=True)
  print(_fmt_families(out["before_rl"], out["after_rl"]), flush=True)
  paired = out.get("delta_pass_at_1_ci95")
  paired = f" (paired 95% CI {paired[0]:+.3f}, {paired[1]:+.3f})" if paired else ""
  print(f"RL raised pass@1 by {out['delta_pass_at_1']:+.3f}{paired}; outside both intervals: "
        f"{out['improved_outside_cis']}; summary in {summary_path}", flush=True)
  return out


def _fmt_families(before: dict, after: dict) -> str:
  """One line: pass@1 per task family before -> after RL (tasks in parentheses)."""
  fams = sorted(set(before.get("by_family", {})) | set(after.get("by_family", {})))
  parts = []
  for f in fams:
    b, a = before.get("by_family", {}).get(f), after.get("by_family", {}).get(f)
    n = (a or b)["n_tasks"]
    parts.append(f"{f} {b['pass_at_1'] if b else float('nan'):.2f} -> "
                 f"{a['pass_at_1'] if a else float('nan'):.2f} ({n})")
  return "pass@1 by task family: " + ", ".join(parts)


def _before_label(config) -> str:
  return "before RL (after SFT)" if config.loop.sft_first and config.sft.steps else "before RL"


def _eval_scalars(s: dict) -> dict:
  return {"pass_at_1": s["pass_at_1"], "pass_at_1_lo": s["pass_at_1_ci95"][0],
          "pass_at_1_hi": s["pass_at_1_ci95"][1], "mean_reward": s["mean_reward"]}


def _finish(summary: dict, config, eval_tasks) -> dict:
  out = dict(summary)
  out["config"] = config.name
  out["eval_subset"] = {"split": "eval", "levels": list(config.loop.eval_levels),
                        "max_tasks": int(config.loop.eval_max_tasks), "n_tasks": len(eval_tasks),
                        "samples_per_task": int(config.loop.eval_samples),
                        "temperature": _eval_temperature(config),
                        "task_ids": [t.id for t in eval_tasks]}
  out["rl_steps"] = int(config.train.steps)
  b, a = out.get("before_rl"), out.get("after_rl")
  if b and a:
    out["delta_pass_at_1"] = a["pass_at_1"] - b["pass_at_1"]
    # The margin is outside both intervals: the after-RL figure lies above the before-RL
    # interval, and the before-RL figure below the after-RL interval.
    out["improved_outside_cis"] = bool(a["pass_at_1"] > b["pass_at_1_ci95"][1]
                                       and b["pass_at_1"] < a["pass_at_1_ci95"][0])
    if "per_task_pass" in b and "per_task_pass" in a:
      out["delta_pass_at_1_ci95"] = paired_bootstrap_delta(
          b["per_task_pass"], a["per_task_pass"], int(config.loop.bootstrap), int(config.seed))
  return out


def _write_json(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def _with_params(step_fn, state, params):
  """A fresh optimizer state around `params` (the SFT moments do not carry over)."""
  import jax
  import jax.numpy as jnp

  def build(p, step, rng):
    return {"params": p, "opt_state": step_fn.optimizer.init(p), "step": step, "rng": rng}
  from models import sharding as shd
  with shd.use_mesh(step_fn.mesh, step_fn.rules):
    return jax.jit(build, out_shardings=step_fn.state_shardings)(
        params, jnp.zeros((), jnp.int32), state["rng"])


def main_rl(config, flags=None):
  _quiet_logs()
  return run_rl(config, flags)
