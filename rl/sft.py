"""The SFT warm start behind `launch.py --mode=sft` (and the first part of `--mode=rl`).

  oracle episodes of the train split through the real harness (worlds, MCP gateways, chat
  format) -> padded batches -> cross-entropy on the sampled (assistant) tokens only, optionally
  plus a language-modelling term and synthetic copy rows -> params saved with orbax under
  runs/<name>/sft (sft.dir), with the fingerprint of the start they were trained from.

`warm_start` is the RL job's SFT step (trains unless params are saved); `start_params` is what
RL starts from: these params, else train.init_from, else the seeded init.
"""
from __future__ import annotations

import functools
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from envs import tasks as tasks_lib
from envs import worlds
from envs.chat import hf_export
from envs.chat.tokenizer import from_config as tokenizer_from_config
from envs.chat.tokenizer import ordinary_id_range
from envs.harness.collate import collate
from envs.harness.oracle import oracle_factory
from envs.harness.pool import AgentPool
from envs.tasks import task_file
from models import qwen3_5
from models import xla_flags
from rl import distributed
from rl import reductions
from rl.metrics import Metrics
from rl.metrics import progress_bar
from rl.metrics import quiet_logs
from rl.run_files import run_dir
from rl.run_files import sft_dir
from rl.run_files import starts_from_sft
from rl.params_io import has_saved_params
from rl.params_io import init_params
from rl.params_io import load_params_and_meta
from rl.params_io import save_params
from rl.params_io import start_fingerprint
from rl.rollout.draw import run_pool
from rl.task_data import make_episodes
from rl.task_data import select_tasks
from rl.train_step import apply_optimizer
from rl.train_step import make_optimizer
from rl.train_step import token_logprobs


def sft_loss(model_cfg, params, batch, lm_weight: float = 0.0):
  """Cross-entropy of the assistant (sampled) tokens, -sum(mask * logp) / sum(mask), plus
  `lm_weight` times the mean next-token loss over every token of the trajectories (system,
  prompt, tool results): the language-modelling signal that teaches a small model from scratch
  to read tool output, which the assistant tokens alone carry too little of."""
  lp, _ = token_logprobs(model_cfg, params, batch["tokens"], 1.0)
  mask = batch["loss_mask"].astype(lp.dtype)
  loss = -(lp * mask).sum() / jnp.maximum(mask.sum(), 1.0)
  if lm_weight:
    pos = jnp.arange(lp.shape[1])[None, :]
    every = ((pos >= 1) & (pos < batch["lengths"][:, None])).astype(lp.dtype)
    loss = loss + lm_weight * -(lp * every).sum() / jnp.maximum(every.sum(), 1.0)
  return loss


def sft_token_weights(batch, lm_weight: float = 0.0):
  """[rows, positions] float32 weights w with sft_loss = -sum(w * logp): 1 / (the batch's
  assistant tokens) on each assistant token, plus lm_weight / (its valid next-token positions) on
  each of those. Taken over the whole batch, they make its micro-batches' losses sum to its own."""
  mask = jnp.asarray(batch["loss_mask"], jnp.float32)
  w = mask / jnp.maximum(mask.sum(), 1.0)
  if lm_weight:
    pos = jnp.arange(mask.shape[1])[None, :]
    every = ((pos >= 1) & (pos < jnp.asarray(batch["lengths"])[:, None])).astype(jnp.float32)
    w = w + lm_weight * every / jnp.maximum(every.sum(), 1.0)
  return w


def weighted_token_loss(model_cfg, params, batch):
  """-sum(weights * logp) of a (micro-)batch {"tokens", "weights"} (`sft_token_weights`)."""
  lp, _ = token_logprobs(model_cfg, params, batch["tokens"], 1.0)
  return -(lp * batch["weights"]).sum()


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


def bucket_len(n: int, multiple: int) -> int:
  """`n` rounded up to a multiple of `multiple`."""
  return -(-int(n) // multiple) * multiple


def sft_eval_fn(model_cfg):
  """jitted (params, batch) -> per-row sums over assistant tokens: (-logp, tokens, argmax hits)."""
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
    t = bucket_len(data["lengths"][rows].max(), multiple)
    a, b, c = eval_fn(params, {"tokens": data["tokens"][rows, :t],
                               "loss_mask": data["loss_mask"][rows, :t]})
    nll.append(np.asarray(a))
    n.append(np.asarray(b))
    hits.append(np.asarray(c))
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
  model_cfg = qwen3_5.config_from_dict(config.model)
  multiple = int(config.sft.pad_multiple) or data["tokens"].shape[1]
  drill_rows = int(config.sft.copy_drill_rows)
  drill_only = int(config.sft.copy_drill_only_steps)
  if drill_only and not drill_rows:
    raise ValueError(f"sft.copy_drill_only_steps={drill_only} needs sft.copy_drill_rows > 0")
  if drill_rows:
    drill_ids = ordinary_id_range(config.tokenizer.special_ids, model_cfg.vocab_size)
  opt = sft_optimizer(config)
  step, drill_step = sft_steps(config, model_cfg, opt)
  eval_fn = sft_eval_fn(model_cfg) if val_data is not None and config.sft.eval_every else None
  params = jax.tree.map(jnp.copy, params)   # the steps donate theirs; the caller's stay whole
  opt_state = opt.init(params)
  rows = np.flatnonzero(data["loss_mask"].sum(1) > 0)
  rng = np.random.default_rng(config.seed)
  drill_rng = np.random.default_rng([config.seed, 1])
  bs = min(int(config.sft.batch_size), len(rows))
  batches: list = []
  steps = int(config.sft.steps)
  with progress_bar(config, steps, "sft") as bar:
    for i in range(steps):
      if not batches:
        batches = length_grouped_batches(rows, data["lengths"], bs, rng)
      drill = (copy_drill_batch(drill_rng, drill_rows, int(config.sft.copy_drill_len), *drill_ids,
                                row_len=int(config.sft.copy_drill_row_len)) if drill_rows else None)
      if i < drill_only:
        params, opt_state, loss, gnorm, drill_loss = drill_step(params, opt_state, drill)
      else:
        take = batches.pop()
        t = min(bucket_len(data["lengths"][take].max(), multiple), data["tokens"].shape[1])
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


def sft_steps(config, model_cfg, opt, backend: Optional[str] = None,
              batch_ways: int = 1) -> tuple:
  """The jitted SFT updates: (params, opt_state, batch, drill) with the copy drill's rows added
  at sft.copy_drill_weight, and (params, opt_state, drill) on drill rows alone (where a small
  model first forms the content-copy circuit; cheap steps). Each returns (params, opt_state,
  loss, grad norm, drill loss), and takes over (donates) the params and opt_state it is given.

  The batch's rows go through the model in sft.micro_batches sequential micro-batches, their
  gradients summed in float32, so a step holds one micro-batch's activations: fewer where that
  count would leave the `batch_ways` devices splitting a micro-batch's rows unequal shares
  (`reductions.micro_batch_count`, as the RL step does). The loss and gradient are the whole
  batch's either way (`sft_token_weights`); the drill's rows, few and short, go in whole.
  """
  lm_weight = float(config.sft.lm_loss_weight)
  drill_weight = float(config.sft.copy_drill_weight)
  micro_batches = int(config.sft.micro_batches)
  # `backend`: the platform the steps compile for (default: this process's; the compile mode
  # builds them for compile-only devices, rl/compile_job.py).

  def total_loss(p, batch, drill):
    loss = sft_loss(model_cfg, p, batch, lm_weight)
    drill_loss = sft_loss(model_cfg, p, drill) if drill is not None else 0.0
    return loss + drill_weight * drill_loss, drill_loss

  def loss_and_grads(p, batch, drill):
    """((loss, drill loss), grads) of total_loss, the batch in micro-batches."""
    n = reductions.micro_batch_count(batch["tokens"].shape[0], micro_batches, batch_ways)
    if n == 1:
      return jax.value_and_grad(total_loss, has_aux=True)(p, batch, drill)
    weighted = {"tokens": batch["tokens"], "weights": sft_token_weights(batch, lm_weight)}
    (loss, _), grads = reductions.microbatched_value_and_grad(
        lambda q, mb: (weighted_token_loss(model_cfg, q, mb), ()), p, weighted, n)
    if drill is None:
      return (loss, 0.0), grads
    drill_loss, drill_grads = jax.value_and_grad(
        lambda q: sft_loss(model_cfg, q, drill))(p)
    grads = jax.tree.map(lambda g, d: g + drill_weight * d, grads, drill_grads)
    return (loss + drill_weight * drill_loss, drill_loss), grads

  def drill_only(p, drill):
    return jax.value_and_grad(lambda q: (sft_loss(model_cfg, q, drill),) * 2, has_aux=True)(p)

  jit = functools.partial(jax.jit,
                          compiler_options=xla_flags.compiler_options(config.train.xla_cpu_dots,
                                                                      backend))

  def make_step(grads_fn):
    # params and opt_state are donated: the step's outputs may take their buffers. Weights the
    # layer scan reads XLA copies anyway, so the saving is what no loop reads
    # (docs/results.md, "Donated state and the layer loop").
    @functools.partial(jit, donate_argnums=(0, 1))
    def step(params, opt_state, *batches):
      (loss, drill_loss), grads = grads_fn(params, *batches)
      params, opt_state, _ = apply_optimizer(opt, grads, opt_state, params)  # dtypes kept
      return params, opt_state, loss, optax.global_norm(grads), drill_loss
    return step

  return make_step(loss_and_grads), make_step(drill_only)


def collect_oracle(config, tasks) -> list:
  """The oracle's episodes on `tasks` through the real harness and worlds."""
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


def check_oracles(config, tasks) -> None:
  """SFT replays each task's oracle: tasks without one (most tasks read from envs.tasks_file,
  all of an APEX-Agents folder) cannot be trained on, and neither --mode=sft nor --mode=rl's SFT
  warm start runs on them."""
  missing = [t.id for t in tasks if not task_file.has_oracle(t)]
  if missing:
    raise ValueError(
        f"SFT replays the tasks' oracle, and {len(missing)} of the {len(tasks)} SFT tasks have "
        f"none (e.g. {missing[:3]}): tasks read from envs.tasks_file="
        f"{config.envs.tasks_file!r} (envs.source={config.envs.source!r}) carry an oracle only "
        "when their file gives one. Run RL without the SFT warm start, from train.init_from: "
        "--config.loop.sft_first=False (or --config.sft.steps=0)")


def run_sft(config, metrics: Optional[Metrics] = None):
  """Oracle data -> SFT from the random init -> params saved to runs/<name>/sft."""
  t0 = time.monotonic()
  tasks = select_tasks(config, "train", config.sft.levels, config.sft.max_tasks)
  check_oracles(config, tasks)
  if tasks_lib.uses_generated_worlds(config.envs):  # tasks from files may bring their own
    worlds.ensure_worlds(config.envs)
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
  model_cfg = qwen3_5.config_from_dict(config.model)

  # Recorded with the saves: a later run reuses them only if it starts from the same weights.
  start = start_fingerprint(config)

  def export(step, params):
    save_params(sft_dir(config), distributed.replicated(params),
                {"steps": int(step), "episodes": len(ok), "start": start}, step)
    if config.sft.export_hf and distributed.is_writer():
      hf_export.save_hf(model_cfg, params, config.sft.export_hf, **hf_export_settings(config))

  params = sft_train(config, data, init_params(config), metrics, val, export)
  steps, every = int(config.sft.steps), int(config.sft.save_every)
  if not (every and steps and steps % every == 0):  # else sft_train's last save was this one
    export(steps, params)
  if config.sft.export_hf:
    print(f"SFT: Hugging Face checkpoint in {config.sft.export_hf}", flush=True)
  print(f"SFT: done in {time.monotonic() - t0:.0f}s; params in {sft_dir(config)}", flush=True)
  return params


def hf_export_settings(config) -> dict:
  """save_hf's tokenizer and generation defaults for a checkpoint of this config: its tokenizer
  (config.tokenizer) and the engine's default sampling (config.rollout)."""
  r = config.rollout
  return {"tokenizer": tokenizer_from_config(config.tokenizer),
          "sampling": {"temperature": float(r.temperature), "top_p": float(r.top_p),
                       "top_k": int(r.top_k)}}


def warm_start(config, metrics: Optional[Metrics] = None) -> bool:
  """The RL job's SFT step, run before its restore: trains SFT into sft_dir(config) when
  loop.sft_first asks for a warm start and nothing is saved there yet (saved params are read by
  `start_params`, which checks what they were trained from). Returns whether it trained."""
  if not starts_from_sft(config):
    return False
  saved = has_saved_params(sft_dir(config))
  if not saved:
    run_sft(config, metrics)
  return not saved


def start_params(config, shardings=None):
  """The weights RL starts from: the SFT result when loop.sft_first asks for one (`warm_start`
  trains it first), else config.train.init_from, else None (the seeded init). Loads only."""
  params = None
  if starts_from_sft(config):
    params, meta = load_params_and_meta(sft_dir(config), config, shardings)
    if params is None:
      raise FileNotFoundError(f"no SFT params in {sft_dir(config)}: the job's SFT step "
                              f"(rl.sft.warm_start) trains them first")
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
  quiet_logs()
  metrics = Metrics(run_dir(config), config.loop.tensorboard)
  try:
    run_sft(config, metrics)
  finally:
    metrics.close()
