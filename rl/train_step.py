"""The GRPO train step: a pure function of pytrees, jitted once with explicit shardings.

    step = TrainStep(config, mesh)               # builds the optimizer, shardings, jit
    state = step.init_state(jax.random.key(0))   # sharded params + AdamW state + step + rng
    state, metrics = step(state, batch)          # state is donated

State (a dict pytree):
  params     the model's parameter tree (sharded by the logical rules)
  opt_state  optax AdamW state (moments sharded like the params)
  step       int32 scalar, optimizer updates done so far
  rng        uint32 [2] key data for the loop's sampling (checkpointed, not used here)
  ref_params only with rl.kl.coef > 0 (and no LoRA): the frozen reference policy (the params
             RL started from), sharded like the params and checkpointed with them, so a
             resumed run keeps its reference

With LoRA (lora.rank > 0, models/lora.py) `params` are the adapters (float32) and the optimizer
state is theirs alone; the base is a frozen input of the step (`TrainStep.base`, in
model.param_dtype, bfloat16 allowed), neither differentiated nor in the state (a checkpoint holds
the adapters and points at the base). The model the step runs is the base with the adapters
merged layer by layer; the KL reference is the base itself, adapters off (no second copy).

Batch (a dict of global arrays, rows sharded over the batch mesh axes):
  tokens            [batch, seq] int32   prompt + trajectory tokens, right padded
  loss_mask         [batch, seq]         1 where the token was sampled by the policy
  rollout_logprobs  [batch, seq] float32 engine logprob of tokens[:, t] (0 where mask is 0)
  rewards           [batch] float32
  group_ids         [batch] int32        equal for the samples of one prompt
  valid             [batch] bool         optional; False excludes a sample (masked group)
  ref_logprobs      [batch, seq] float32 optional; with rl.kl.coef > 0 and none given, the step
                    computes them from state["ref_params"]

Token t is predicted by the logits at t - 1, so tokens[:, 0] never carries loss.

Inside one call: advantages over the whole batch (groups need all their samples), optional
recompute of the old logprobs with the incoming params, the reference policy's logprobs when
the KL penalty is on (a forward pass of the reference per live micro-batch), then
`train.mini_batches` optimizer updates, each over a strided slice of the batch, each
accumulating gradients over `train.micro_batches` micro-batches in a lax.scan (fewer where a
micro-batch would give the devices splitting its rows unequal shares: `micro_batches`). Loss
reduction weights are computed per mini-batch from the whole mini-batch (rl/reductions.py), so
micro-batching and data parallelism do not change the loss or the gradients.
"""
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from models import lora
from models.layers import moe
from models import qwen3_5
from models import sharding
from models import xla_flags
from rl import advantages
from rl import reductions
from rl import policy_losses
from rl.train_example import TrainExample

REQUIRED_BATCH_KEYS = ("tokens", "loss_mask", "rollout_logprobs", "rewards", "group_ids")


# ----------------------------------------------------------------------------- optimizer


def make_schedule(optim: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to lr, then constant or cosine decay to lr * min_lr_ratio."""
  warmup = int(optim.warmup_steps)
  if optim.schedule == "constant":
    after = optax.constant_schedule(optim.lr)
  elif optim.schedule == "cosine":
    decay = int(optim.decay_steps) or max(total_steps - warmup, 1)
    after = optax.cosine_decay_schedule(optim.lr, decay, alpha=optim.min_lr_ratio)
  else:
    raise ValueError(f"unknown optim.schedule {optim.schedule!r}; use constant | cosine")
  if warmup <= 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, optim.lr, warmup), after], [warmup])


OPTIMIZERS = ("adamw", "sgd")


def make_optimizer(optim: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  """Global-norm gradient clipping, then `optim.name`: AdamW (betas, eps, decoupled weight
  decay) or SGD with momentum b1 and the same decoupled weight decay.

  Why SGD is offered: Adam divides each coordinate by its own running RMS, so in its first
  steps every weight moves by about the learning rate whatever its gradient (step 1 is a sign
  step). With a few informative groups a step, most coordinates' gradients are noise, and Adam
  moves them as far as the ones that carry the signal; SGD moves each in proportion to its
  gradient."""
  name = optim.name
  if name not in OPTIMIZERS:
    raise ValueError(f"unknown optim.name {name!r}; use one of {OPTIMIZERS}")
  pattern = optim.get("trainable", "")
  if pattern:
    try:
      re.compile(pattern)
    except re.error as e:
      raise ValueError(f"optim.trainable {pattern!r} is not a regular expression: {e}") from None
  parts = []
  if optim.grad_clip:
    parts.append(optax.clip_by_global_norm(optim.grad_clip))
  schedule = make_schedule(optim, total_steps)
  if name == "adamw":
    parts.append(optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                             weight_decay=optim.weight_decay, mu_dtype=jnp.dtype(optim.mu_dtype)))
  else:
    if optim.weight_decay:
      parts.append(optax.add_decayed_weights(optim.weight_decay))
    parts.append(optax.sgd(schedule, momentum=optim.b1 or None,
                           accumulator_dtype=jnp.dtype(optim.mu_dtype)))
  tx = optax.chain(*parts)
  return only_trainable(pattern, tx) if pattern else tx


def param_path(path) -> str:
  """'blocks/3/mixer/q_norm' for a key path of the parameter tree."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


def trainable_mask(pattern: str, tree) -> Any:
  """True for each leaf whose path (`param_path`) re.search-matches `pattern`; a pattern that
  matches no leaf is an error, not a run that trains nothing."""
  mask = jax.tree_util.tree_map_with_path(
      lambda path, _: re.search(pattern, param_path(path)) is not None, tree)
  if not any(jax.tree_util.tree_leaves(mask)):
    names = [param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    raise ValueError(f"optim.trainable {pattern!r} matches no parameter; they are named like "
                     f"{names[:3]} ... {names[-1:]}")
  return mask


def only_trainable(pattern: str, tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` over the leaves `pattern` matches; the others get a zero update.

  Gradients of frozen leaves are zeroed before `tx` (so clipping's global norm is over the
  trainable ones) and its updates after (so weight decay leaves them too). The state keeps
  `tx`'s structure, moments of frozen leaves staying 0, so the state's shardings are the
  plain optimizer's (optax.multi_transform's masked state has no parameter-shaped trees for
  optax.tree_map_params to map)."""

  def init(params):
    if any(hasattr(x, "shape") for x in jax.tree_util.tree_leaves(params)):
      trainable_mask(pattern, params)  # fail at init, not at the first step
    return tx.init(params)

  def update(updates, state, params=None):
    mask = trainable_mask(pattern, updates)
    zero_frozen = lambda tree: jax.tree_util.tree_map(
        lambda u, keep: u if keep else jnp.zeros_like(u), tree, mask)
    updates, state = tx.update(zero_frozen(updates), state, params)
    return zero_frozen(updates), state

  return optax.GradientTransformation(init, update)


def cast_like(tree, like):
  """`tree` with each leaf cast to the dtype of the matching leaf of `like`."""
  return jax.tree.map(lambda x, ref: x.astype(ref.dtype), tree, like)


def apply_optimizer(optimizer: optax.GradientTransformation, grads, opt_state, params):
  """One optimizer update -> (params, opt_state, updates), every leaf in its input's dtype.

  With bfloat16 params the updates come out float32 (the schedule's learning rate and a
  float32 first moment promote them); optax.apply_updates adds them in float32 and rounds the
  sum to the param's dtype once. The updates are returned in the gradients' dtype and the
  state in its own, so a step's state keeps its types from step to step and the branches of a
  lax.cond around the update (`TrainStep._apply`) agree. Rounding to bfloat16 drops an update
  under half the weight's spacing (2^-9 to 2^-8 of its size: lr 1e-6 on a weight of 0.02 moves
  nothing); float32 params with bfloat16 compute keep such steps."""
  updates, new_state = optimizer.update(grads, opt_state, params)
  return (optax.apply_updates(params, updates), cast_like(new_state, opt_state),
          cast_like(updates, grads))


# ----------------------------------------------------------------------------- model pieces


def token_logprobs(model_cfg, params, tokens, temperature: float, with_router: bool = False):
  """Logprob and entropy of every token under the policy, aligned with `tokens`.

  Returns logprobs [batch, seq] f32 (0 at t = 0), entropy [batch, seq] f32 (0 at t = 0), and
  the router logits when `with_router` (tuple over cycle positions, see models.qwen3_5).
  """
  hidden, router = qwen3_5.forward_hidden(model_cfg, params, tokens)
  lp, ent = qwen3_5.token_logprobs(model_cfg, params, hidden[:, :-1], tokens[:, 1:], temperature)
  pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
  lp = jnp.concatenate([pad, lp], axis=1)
  ent = jnp.concatenate([pad, jax.lax.stop_gradient(ent)], axis=1)
  return (lp, ent, router) if with_router else (lp, ent)


def load_balancing_loss(router_logits, num_experts: int, top_k: int) -> jax.Array:
  """Switch-style auxiliary loss E * sum_e f_e * P_e, averaged over MoE layers.

  f_e: share of (token, slot) assignments to expert e; P_e: mean router probability of e.
  Equals 1 for perfectly uniform routing. router_logits: tuple of [cycles, tokens, experts].
  """
  losses = []
  for r in router_logits:
    if r is None:
      continue
    probs = jax.nn.softmax(r.astype(jnp.float32), axis=-1)                # [c, n, e]
    _, idx = moe.top_k(probs, top_k)
    f = jax.nn.one_hot(idx, num_experts, dtype=jnp.float32).sum(-2).mean(-2) / top_k  # [c, e]
    p = probs.mean(-2)                                                     # [c, e]
    losses.append(num_experts * (f * p).sum(-1))                           # [c]
  if not losses:
    return jnp.float32(0.0)
  return jnp.concatenate(losses).mean()


# ----------------------------------------------------------------------------- the step


def row_lengths(train: ml_collections.ConfigDict) -> tuple:
  """The row lengths a batch may have, ascending: train.seq_buckets and train.seq_len."""
  return tuple(sorted({int(b) for b in train.seq_buckets} | {int(train.seq_len)}))


class TrainStep:
  """Builds the optimizer, state shardings and the jitted step for one config and mesh."""

  def __init__(self, config: ml_collections.ConfigDict, mesh, model_cfg=None,
               return_grads: bool = False):
    """return_grads: also return the (last mini-batch's) gradients in the metrics, replicated.
    For tests and debugging of small models only."""
    self.config = config
    self.return_grads = return_grads
    self.mesh = mesh
    self.rules = sharding.rules_from_config(config.mesh.rules)
    # Over how many devices a batch's rows are split (the micro-batches' rows: micro_batches).
    self.batch_ways = sharding.ways(mesh.shape, self.rules, "batch")
    self.model_cfg = model_cfg or qwen3_5.config_from_dict(config.model)
    self.optimizer = make_optimizer(config.optim, config.train.steps)
    # LoRA: the state's params are adapters over the frozen `self.base` (set_base).
    self.lora = lora.from_config(config.lora) if "lora" in config else None
    self.base = None
    # The KL penalty's reference policy: the state's "ref_params", or with LoRA the base.
    self.uses_ref = bool(config.rl.kl.coef)
    self.keeps_ref = self.uses_ref and self.lora is None
    self.base_shardings = sharding.tree_shardings(
        qwen3_5.param_axes(self.model_cfg), self._base_shapes(), mesh, self.rules)
    self.state_shardings = self._state_shardings()
    self._jitted = None
    self._batch_signature = None

  # -- state -------------------------------------------------------------------------------

  def _base_shapes(self):
    return jax.eval_shape(lambda k: qwen3_5.init_params(self.model_cfg, k), jax.random.key(0))

  def _init_state(self, key):
    k_params, k_rng = jax.random.split(key)
    if self.lora is None:
      params = qwen3_5.init_params(self.model_cfg, k_params)
    else:
      params = lora.init(self.lora, qwen3_5.param_axes(self.model_cfg), self._base_shapes(),
                         k_params)
    return self.state_around(params, jnp.zeros((), jnp.int32), jax.random.key_data(k_rng))

  def init_base(self, key):
    """The seeded base (LoRA without a checkpoint to start from): the params `init_state`
    draws from `key` without LoRA, sharded."""
    k_params, _ = jax.random.split(key)
    with sharding.use_mesh(self.mesh, self.rules):
      return jax.jit(lambda k: qwen3_5.init_params(self.model_cfg, k),
                     out_shardings=self.base_shardings)(k_params)

  def set_base(self, params):
    """Places `params` as the frozen base the adapters apply to (LoRA only)."""
    if self.lora is None:
      raise ValueError("set_base: lora.rank is 0, the step trains the params themselves")
    self.base = jax.device_put(params, self.base_shardings)

  def model_params(self, params, base=None):
    """What the model runs: `params`, or with LoRA the base with the adapters `params` attached
    (call inside a traced function)."""
    if self.lora is None:
      return params
    return lora.attach(self.base if base is None else base, params, self.lora.scale)

  def state_around(self, params, step, rng) -> dict:
    """A train state starting from `params`: a fresh optimizer state and, with the KL penalty
    on, `params` as the reference policy too."""
    state = {"params": params, "opt_state": self.optimizer.init(params), "step": step,
             "rng": rng}
    if self.keeps_ref:
      state["ref_params"] = jax.tree.map(jnp.copy, params)
    return state

  def abstract_state(self):
    """ShapeDtypeStructs of the state (with shardings); allocates nothing."""
    shapes = jax.eval_shape(self._init_state, jax.random.key(0))
    return sharding.with_shardings(shapes, self.state_shardings)

  def _state_shardings(self):
    shapes = jax.eval_shape(self._init_state, jax.random.key(0))
    axes = qwen3_5.param_axes(self.model_cfg)
    if self.lora is not None:
      axes = lora.axes(self.lora, axes)
    param_sh = sharding.tree_shardings(axes, shapes["params"], self.mesh, self.rules)
    rep = sharding.replicated(self.mesh)
    opt_sh = optax.tree_map_params(self.optimizer, lambda _, sh: sh, shapes["opt_state"],
                                   param_sh, transform_non_params=lambda _: rep)
    out = {"params": param_sh, "opt_state": opt_sh, "step": rep, "rng": rep}
    if self.keeps_ref:
      out["ref_params"] = param_sh
    return out

  def init_state(self, key):
    """Sharded initial state: every device materialises only its own shards."""
    with sharding.use_mesh(self.mesh, self.rules):
      return jax.jit(self._init_state, out_shardings=self.state_shardings)(key)

  # -- batch -------------------------------------------------------------------------------

  def batch_shardings(self, batch):
    return {k: sharding.batch_sharding(self.mesh, self.rules, v.ndim, v.shape[0])
            for k, v in batch.items()}

  def shard_batch(self, batch):
    """Host (numpy) batch -> global arrays laid out over the batch mesh axes. `batch` is a
    `TrainExample` (the RL loop's) or its `as_arrays()` dict (with extra keys, e.g.
    ref_logprobs)."""
    if isinstance(batch, TrainExample):
      batch = batch.as_arrays()
      if jax.process_count() > 1:
        # Every process holds the step's whole batch (rl/rollout/draw.py gathers the episodes);
        # each contributes its own block of rows, the ones its devices hold.
        n, i = jax.process_count(), jax.process_index()
        batch = {k: v[i * len(v) // n:(i + 1) * len(v) // n] for k, v in batch.items()}
    return sharding.shard_batch(batch, self.mesh, self.rules)

  def micro_batches(self, rows: int) -> int:
    """How many micro-batches `rows` rows run in: train.micro_batches, or fewer where that would
    give the devices splitting the rows unequal shares (`reductions.micro_batch_count`)."""
    return reductions.micro_batch_count(rows, int(self.config.train.micro_batches),
                                        self.batch_ways)

  # -- loss --------------------------------------------------------------------------------

  @property
  def _router_loss(self) -> bool:
    """Whether the MoE load-balancing loss is on (it needs the router logits)."""
    return bool(self.config.rl.moe_aux_loss_coef) and self.model_cfg.use_moe

  def _micro_loss(self, params, mb, micro_batches: int):
    """Loss and metric SUMS of one micro-batch of `micro_batches`, weighted with
    whole-mini-batch weights."""
    rl = self.config.rl
    want_router = self._router_loss
    out = token_logprobs(self.model_cfg, params, mb["tokens"], rl.temperature, want_router)
    lp, ent = out[0], out[1]
    x = policy_losses.PolicyInputs(logprobs=lp, old_logprobs=mb["old_logprobs"],
                        rollout_logprobs=mb["rollout_logprobs"],
                        advantages=jnp.broadcast_to(mb["advantages"][:, None], lp.shape),
                        loss_mask=mb["loss_mask"])
    token_loss, token_metrics = policy_losses.compute_policy_loss(
        x, rl, mb.get("ref_logprobs"), ent)
    loss = jnp.sum(mb["weights"] * token_loss)
    aux = {k: jnp.sum(mb["metric_weights"] * v) for k, v in token_metrics.items()}
    aux["loss/policy"] = jax.lax.stop_gradient(loss)
    if want_router:
      # Each micro-batch adds its own balance loss / micro_batches: the mean over micro-batches.
      # Unlike the policy loss this is not invariant to the micro-batch count: the balance loss
      # is a product of token means (routed fraction x mean router probability), and a
      # micro-batch's product is not its share of the whole batch's. Exact invariance would
      # need the routed fractions of the whole batch before any backward pass (a second
      # forward of every micro-batch), which this step does not pay for.
      lb = load_balancing_loss(out[2], self.model_cfg.num_experts,
                               self.model_cfg.num_experts_per_tok) / micro_batches
      loss = loss + rl.moe_aux_loss_coef * lb
      aux["loss/moe_load_balance"] = jax.lax.stop_gradient(lb)
    return loss, aux

  def loss_and_grads(self, params, mini, base=None):
    """(loss, metric sums), grads of one prepared mini-batch, accumulated over micro-batches.
    With LoRA `params` are the adapters and only they are differentiated (`base`: the frozen
    base, default `self.base`)."""
    # A micro-batch without a loss token adds exactly zero, unless the MoE balance loss (which
    # every micro-batch adds whatever its mask) is on; then every micro-batch is computed.
    is_live = None if self._router_loss else (lambda mb: mb["loss_mask"].sum() > 0)
    n = self.micro_batches(mini["tokens"].shape[0])
    loss = lambda p, mb: self._micro_loss(self.model_params(p, base), mb, n)
    return reductions.microbatched_value_and_grad(loss, params, mini, n, is_live,
                                            self.state_shardings["params"])

  def batch_logprobs(self, params, tokens, mask=None):
    """Token logprobs [batch, seq] of `tokens` under `params`, one micro-batch at a time (the
    memory of one micro-batch's forward pass), without gradient. With `mask` [batch, seq], a
    micro-batch without a loss token is not computed (zeros: no loss term reads them)."""
    n = self.micro_batches(tokens.shape[0])
    temperature = self.config.rl.temperature

    def forward(t):
      return token_logprobs(self.model_cfg, params, t, temperature)[0]

    if mask is None:
      lp = jax.lax.map(forward, reductions.split_micro_batches(tokens, n))
    else:
      def one(args):
        t, m = args
        return jax.lax.cond(m.sum() > 0, forward,
                            lambda t: jnp.zeros(t.shape, jnp.float32), t)
      lp = jax.lax.map(one, reductions.split_micro_batches((tokens, mask), n))
    return jax.lax.stop_gradient(jnp.swapaxes(lp, 0, 1).reshape(tokens.shape))

  def prepare(self, params, batch, ref_params=None):
    """Advantages, validity, old and reference logprobs: everything computed once over the
    whole batch. `params`, `ref_params`: what the model runs (`model_params`)."""
    rl = self.config.rl
    b = batch["tokens"].shape[0]
    valid = batch.get("valid", jnp.ones((b,), bool))
    adv, valid, adv_metrics = advantages.compute_advantages(
        batch["rewards"], batch["group_ids"], valid, rl)
    mask = batch["loss_mask"].astype(jnp.float32) * valid[:, None]
    if rl.recompute_old_logprobs:
      old = self.batch_logprobs(params, batch["tokens"])
    else:
      old = batch["rollout_logprobs"]
    prepared = {"tokens": batch["tokens"], "loss_mask": mask, "advantages": adv,
                "old_logprobs": old.astype(jnp.float32),
                "rollout_logprobs": batch["rollout_logprobs"].astype(jnp.float32),
                "group_ids": batch["group_ids"]}
    if "ref_logprobs" in batch:
      prepared["ref_logprobs"] = batch["ref_logprobs"].astype(jnp.float32)
    elif ref_params is not None:
      prepared["ref_logprobs"] = self.batch_logprobs(ref_params, batch["tokens"], mask)
    return prepared, adv_metrics

  def add_weights(self, mini):
    """Reduction weights and token-mean metric weights of a mini-batch (whole-mini-batch)."""
    rl = self.config.rl
    mask = mini["loss_mask"]
    mini = dict(mini)
    # Dr. GRPO's constant is the configured row length, not the row length this step was
    # padded to (train.seq_buckets), so that it is one constant across steps.
    mini["weights"] = reductions.reduction_weights(mask, mini["group_ids"], rl.loss_reduction,
                                             rl.max_seq_len or int(self.config.train.seq_len))
    mini["metric_weights"] = mask / jnp.maximum(mask.sum(), 1.0)
    return mini

  # -- step --------------------------------------------------------------------------------

  def _apply(self, grads, opt_state, params, live):
    """One optimizer update, or none when the mini-batch has no loss token (train.skip_empty_updates).

    Without a sampled token left (every group filtered or masked) the gradient is zero, but AdamW
    would still move every weight along its momentum, decay them, and count the step in its bias
    correction: a policy change backed by no sample of this batch. With the MoE balance loss on,
    such a mini-batch's balance-loss gradient is dropped with it.
    """
    def update(args):
      return apply_optimizer(self.optimizer, *args)

    def skip(args):
      g, o, p = args
      return p, o, jax.tree.map(jnp.zeros_like, g)

    if not self.config.train.skip_empty_updates:
      return update((grads, opt_state, params))
    return jax.lax.cond(live, update, skip, (grads, opt_state, params))

  def _step(self, state, batch, base=None):
    for k in REQUIRED_BATCH_KEYS:
      if k not in batch:
        raise KeyError(f"train batch lacks {k!r}; needs {REQUIRED_BATCH_KEYS}")
    params, opt_state = state["params"], state["opt_state"]
    # With LoRA the reference policy is the base, adapters off.
    ref = base if self.lora is not None and self.uses_ref else state.get("ref_params")
    prepared, adv_metrics = self.prepare(self.model_params(params, base), batch, ref)
    n_mini = self.config.train.mini_batches
    minis = reductions.split_micro_batches(prepared, n_mini) if n_mini > 1 else None
    sums = []
    for i in range(n_mini):
      mini = prepared if minis is None else jax.tree.map(lambda x: x[i], minis)
      mini = self.add_weights(mini)
      (loss, aux), grads = self.loss_and_grads(params, mini, base)
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
      params, opt_state, updates = self._apply(grads, opt_state, params,
                                               mini["loss_mask"].sum() > 0)
      aux = dict(aux, **{"loss/total": loss, "optim/grad_norm": optax.global_norm(grads),
                         "optim/update_norm": optax.global_norm(updates),
                         "tokens/loss_tokens": mini["loss_mask"].sum()})
      sums.append(aux)
    metrics = jax.tree.map(lambda *xs: sum(xs) / len(xs), *sums)
    if self.return_grads:
      metrics["grads"] = grads
    metrics.update(adv_metrics)
    step = state["step"] + n_mini
    metrics["optim/lr"] = make_schedule(self.config.optim, self.config.train.steps)(step - 1)
    metrics["tokens/live_sequences"] = (prepared["loss_mask"].sum(1) > 0).sum()
    new_state = {"params": params, "opt_state": opt_state, "step": step, "rng": state["rng"]}
    if self.keeps_ref:
      new_state["ref_params"] = state["ref_params"]
    return new_state, metrics

  def row_lengths(self) -> tuple:
    return row_lengths(self.config.train)

  def _compiled_for(self, batch):
    """The jitted step; built for the batch layout of the first call. Later batches may differ
    from it only in their row length, one of `row_lengths` (one compile each)."""
    row_len = int(batch["tokens"].shape[1])
    # Shapes and dtypes with the row length of the [batch, row] arrays left out.
    layout = {k: ((v.shape[0], "row") if v.ndim == 2 else tuple(v.shape), str(v.dtype))
              for k, v in batch.items()}
    if self._jitted is None:
      self._batch_signature = (layout, row_len)
      in_shardings = (self.state_shardings, self.batch_shardings(batch))
      if self.lora is not None:   # the frozen base: an input, never donated or returned
        in_shardings += (self.base_shardings,)
      self._jitted = jax.jit(
          self._step, in_shardings=in_shardings,
          out_shardings=(self.state_shardings, sharding.replicated(self.mesh)),
          donate_argnums=(0,),
          # The mesh's platform, not the process's: the compile mode builds this step for
          # compile-only TPU / GPU devices from a CPU process (rl/compile_job.py).
          compiler_options=xla_flags.compiler_options(self.config.train.xla_cpu_dots,
                                                      self.mesh.devices.flat[0].platform))
    elif layout != self._batch_signature[0] or (
        row_len != self._batch_signature[1] and row_len not in self.row_lengths()):
      raise ValueError(f"batch layout changed: {layout}, rows of {row_len} vs "
                       f"{self._batch_signature}; pad batches to one shape (row lengths "
                       f"{self.row_lengths()}: train.seq_buckets, train.seq_len) so the step "
                       f"compiles once per row length")
    return self._jitted

  def _base_args(self, abstract: bool = False) -> tuple:
    """The step's trailing arguments: () without LoRA, else (the base,); `abstract`: its
    shapes and shardings when no base is set (lowering only)."""
    if self.lora is None:
      return ()
    if self.base is None:
      if not abstract:
        raise ValueError("LoRA step without a base: call TrainStep.set_base first")
      return (sharding.with_shardings(self._base_shapes(), self.base_shardings),)
    return (self.base,)

  def __call__(self, state, batch):
    with sharding.use_mesh(self.mesh, self.rules):
      return self._compiled_for(batch)(state, batch, *self._base_args())

  def lower(self, state, batch):
    """Lowers the step for (abstract) state and batch without running it."""
    with sharding.use_mesh(self.mesh, self.rules):
      return self._compiled_for(batch).lower(state, batch, *self._base_args(abstract=True))
