"""The device programs of a QwenEngine (rl/rollout/engine.py) and the decode state they run on.

`EnginePrograms` builds and holds the jitted programs serving runs: `prefill` (a prompt padded
to its bucket), `extend` (the tokens after the shared prefix's cached state), `append` (the
tokens after a kept turn's slot state), `insert` (a prefix into a decode slot), `generate`
(one token for every slot) and `score` (a prompt's own token logprobs); the decode state, placed
or as abstract shapes (`decode_state`); and their lowering for the compile mode (`lower`). The
engine decides what runs when; this module is what runs.

Decode state (one row per slot):
  cache        the model's decode cache (qwen3_5.init_cache): KV [cycles, slots, max_len, kv, hd]
               for the attention layers, conv [cycles, slots, k-1, conv] + ssm [cycles, slots,
               v_heads, dk, dv] f32 for the Gated DeltaNet layers; "pos" [slots] int32.
  logits       [slots, vocab] f32, the next-token logits of each slot.
  key          [slots, 2] uint32 raw PRNG key of the request; the draw at step s uses
               fold_in(key, s), so a request samples the same ids in any slot or batch.
  step         [slots] int32, tokens sampled so far.
  temperature, top_p [slots] f32; top_k [slots] int32: the request's sampling settings.
  stop [slots, MAX_STOP_IDS] int32 (-1 = none), budget [slots] int32: the request's stop ids and
               token budget; done [slots] bool: the slot stopped changing (`hold_finished`).
  version      [slots] int32: the weights version the slot's prefix was computed with.

A prefix (what prefill, extend and append return) carries the last prompt position's logits,
and `generate` samples first, then feeds the sampled token through the model: every step emits
exactly one token per slot, the first included, and the sampling code lives in one place.
"""
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import qwen3_5
from models import sharding
from rl.rollout import engine_weights
from rl.rollout import sampling

# Alternatives `score` returns at each prompt position (the most `top_logprobs` a request gets).
TOP_LOGPROBS = 20
# Prompt positions whose vocabulary-sized logprobs `score` holds at once.
SCORE_CHUNK = 256

# Stop ids a slot can watch for on the device (the freeze of a finished slot's state); a request
# with more is served as before, its turn not kept.
MAX_STOP_IDS = 8


def _split_seed(seed: int) -> tuple[np.uint32, np.uint32]:
  seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
  return np.uint32(seed & 0xFFFF_FFFF), np.uint32(seed >> 32)


def request_args(version: int, seed: int = 0, temperature: float = 1.0, top_k: int = 0,
            top_p: float = 1.0, stop_ids: Sequence[int] = (), budget: int = 0) -> tuple:
  """The `request` arguments of prefill / extend / append: a request's own settings, which
  travel with its prefix into the slot. The defaults are a prefix no request samples from (the
  shared prefix's own cache)."""
  lo, hi = _split_seed(seed)
  stop = np.full((MAX_STOP_IDS,), -1, np.int32)
  stop[:min(len(stop_ids), MAX_STOP_IDS)] = list(stop_ids)[:MAX_STOP_IDS]
  return (lo, hi, np.float32(temperature), np.int32(top_k), np.float32(top_p), stop,
          np.int32(budget), np.int32(version))


class EnginePrograms:
  """The engine's jitted programs and its decode state.

  Args:
    cfg: the model config.
    slots: decode slots (rows of the decode state).
    max_len: tokens per slot.
    cache_dtype: KV / conv dtype of the decode state.
    mesh, rules: device mesh and logical-axis rules (models/sharding.py); None = one device.
    hold_finished: a slot whose request has sampled a stop id or its budget stops changing
      (`done`), so that its state is the conversation's when the turn is kept
      (rl/rollout/engine_caches.py).
    abstract_on: None, or the (compile-only) device of an engine without a mesh that only
      lowers its programs.

  The programs (jax.jit objects, called inside `context()`):
    prefill(params, tokens [1, bucket], length [1], *request) -> prefix
    extend(params, prefix_cache, tokens, length, *request) -> prefix
    append(params, turn_cache, tokens, length, *request, key_len) -> prefix
    insert(prefix, state, slot) -> state (`state` donated)
    generate(params, state, version, kind) -> (state, data [slots, 3], logprobs [slots, 1])
      (`state` donated; `kind`: the sampler's, one of sampling.KINDS, chosen on the host from
      the slots' settings: a program each, none with a branch; None: one program choosing on
      the device, as `rollout.sampler_choice="device"` runs)
    score(params, tokens [1, bucket]) -> (logprobs [bucket], top logprobs, top ids [bucket, K])
  """

  def __init__(self, cfg, *, slots: int, max_len: int, cache_dtype, mesh=None, rules=None,
               hold_finished: bool = False, abstract_on: Optional[Any] = None):
    self.cfg = cfg
    self.slots = int(slots)
    self.max_len = int(max_len)
    self.cache_dtype = jnp.dtype(cache_dtype)
    self.mesh = mesh
    self.rules = rules
    self.hold_finished = bool(hold_finished)
    self._abstract_on = abstract_on
    self.prefill = jax.jit(self._prefill)
    self.extend = jax.jit(self._extend)
    # Not donated: the kept KV is cut to key_len, so its buffers could not hold the result.
    self.append = jax.jit(self._append, static_argnames=("key_len",))
    self.insert = jax.jit(self._insert, donate_argnums=(1,))
    self.generate = jax.jit(self._generate, donate_argnums=(1,), static_argnames=("kind",))
    self.score = jax.jit(self._score)

  def context(self):
    """The context the programs run in: the mesh and its rules installed (nothing on one
    device)."""
    return engine_weights.mesh_context(self.mesh, self.rules)

  def _one_device(self) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(self._abstract_on or jax.local_devices()[0])

  def decode_state(self, abstract: bool = False):
    """The empty decode state of every slot, placed; with `abstract`, its ShapeDtypeStructs
    with their shardings (nothing allocated)."""
    b, v = self.slots, self.cfg.vocab_size
    make = lambda: {
        "cache": qwen3_5.init_cache(self.cfg, b, self.max_len, self.cache_dtype),
        "logits": jnp.zeros((b, v), jnp.float32),
        "key": jnp.zeros((b, 2), jnp.uint32),
        "step": jnp.zeros((b,), jnp.int32),
        "temperature": jnp.ones((b,), jnp.float32),
        "top_k": jnp.zeros((b,), jnp.int32),
        "top_p": jnp.ones((b,), jnp.float32),
        "stop": jnp.full((b, MAX_STOP_IDS), -1, jnp.int32),
        "budget": jnp.zeros((b,), jnp.int32),
        "version": jnp.full((b,), -1, jnp.int32),
        "done": jnp.ones((b,), bool),   # an empty slot has nothing to advance
    }
    shapes = jax.eval_shape(make)
    if self.mesh is not None:
      cache_sh = sharding.tree_shardings(qwen3_5.cache_axes(self.cfg), shapes["cache"],
                                         self.mesh, self.rules)
      rest = {k: sharding.batch_sharding(self.mesh, self.rules, x.ndim, b)
              for k, x in shapes.items() if k != "cache"}
      where = dict(rest, cache=cache_sh)
    else:
      where = jax.tree.map(lambda _: self._one_device(), shapes)
    if abstract:
      return sharding.with_shardings(shapes, where)
    state = make()
    return jax.device_put(state, where) if self.mesh is not None else state

  def lower(self, params, buckets: Sequence[int], kind: Optional[str]) -> dict:
    """name -> `jax.stages.Lowered` of the programs serving runs: a prefill and an insert per
    prompt bucket in `buckets` and the generate step of sampler kind `kind`, for `params`
    (ShapeDtypeStructs with their shardings) and abstract inputs of the shapes and shardings
    serving gives them. Nothing runs and nothing is allocated."""
    state = self.decode_state(abstract=True)
    one = (self.mesh and sharding.replicated(self.mesh)) or self._one_device()
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=one)
    req = (sds((), jnp.uint32), sds((), jnp.uint32), sds((), jnp.float32), sds((), jnp.int32),
           sds((), jnp.float32), sds((MAX_STOP_IDS,), jnp.int32), sds((), jnp.int32),
           sds((), jnp.int32))
    out = {}
    with self.context():
      for b in buckets:
        prefill = self.prefill.lower(params, sds((1, b), jnp.int32), sds((1,), jnp.int32), *req)
        out[f"prefill_{b}"] = prefill
        prefix = jax.tree.map(lambda x: sds(x.shape, x.dtype), prefill.out_info)
        out[f"insert_{b}"] = self.insert.lower(prefix, state, sds((), jnp.int32))
      out["generate"] = self.generate.lower(params, state, sds((), jnp.int32), kind=kind)
    return out

  # -- the programs' bodies -------------------------------------------------------------------
  # `request` below: (seed_lo, seed_hi, temperature, top_k, top_p, stop [K], budget, version),
  # the request's own settings, which travel with its prefix into the slot (`request_args`).

  def _prefill(self, params, tokens, length, *request):
    """tokens [1, bucket] int32, length [1] int32 -> prefix (KV length = bucket)."""
    # KV length = bucket: a short prompt's prefix stays small; insert pads it to max_len.
    logits, cache = qwen3_5.prefill(self.cfg, params, tokens, length, tokens.shape[1])
    return self._prefix(logits, cache, *request)

  def _extend(self, params, prefix_cache, tokens, length, *request):
    """The shared prefix's cache (KV length P) + tokens [1, bucket] after it -> prefix (KV length
    P + bucket)."""
    logits, cache = qwen3_5.prefill_extend(self.cfg, params, prefix_cache, tokens, length)
    return self._prefix(logits, cache, *request)

  def _append(self, params, turn_cache, tokens, length, *request, key_len: int):
    """A kept turn's slot cache + tokens [1, bucket] after it, written in place -> prefix (KV
    length key_len).

    The kept KV (length max_len) is cut to `key_len` (>= the tokens kept + bucket) first, so the
    new tokens are scored against the keys up to where they can reach rather than all max_len;
    insert pads the prefix back to max_len.
    """
    cut = lambda x, k: x[:, :, :key_len] if k in ("k", "v") else x
    turn_cache = {"pos": turn_cache["pos"],
                  "blocks": tuple({k: cut(v, k) for k, v in b.items()} for b in turn_cache["blocks"])}
    logits, cache = qwen3_5.prefill_append(self.cfg, params, turn_cache, tokens, length)
    return self._prefix(logits, cache, *request)

  @staticmethod
  def _prefix(logits, cache, seed_lo, seed_hi, temperature, top_k, top_p, stop, budget, version):
    key = jax.random.fold_in(jax.random.key(seed_lo), seed_hi)
    one = lambda x, dt: jnp.reshape(x, (1,) + jnp.shape(x)).astype(dt)
    return {"cache": cache, "logits": logits,
            "key": jax.random.key_data(key)[None].astype(jnp.uint32),
            "temperature": one(temperature, jnp.float32), "top_k": one(top_k, jnp.int32),
            "top_p": one(top_p, jnp.float32), "stop": one(stop, jnp.int32),
            "budget": one(budget, jnp.int32), "version": one(version, jnp.int32)}

  def _insert(self, prefix, state, slot):
    cache = qwen3_5.cache_insert(state["cache"], prefix["cache"], slot)
    put = lambda dst, src: jax.lax.dynamic_update_index_in_dim(dst, src.astype(dst.dtype), slot, 0)
    out = {"cache": cache, "step": put(state["step"], jnp.zeros((1,), jnp.int32)),
           "done": put(state["done"], jnp.zeros((1,), bool))}
    for name in ("logits", "key", "temperature", "top_k", "top_p", "stop", "budget", "version"):
      out[name] = put(state[name], prefix[name])
    return out

  def _generate(self, params, state, version, kind):
    # Each row's key for this step; a batch of greedy rows draws nothing (sampling.sample) and
    # skips the derivation too.
    fold = jax.vmap(lambda k, s: jax.random.key_data(
        jax.random.fold_in(jax.random.wrap_key_data(k), s)))
    if kind is None:   # chosen on the device (rollout.sampler_choice = "device")
      raw = jax.lax.cond(jnp.all(state["temperature"] <= 0), lambda k, s: jnp.zeros_like(k),
                         fold, state["key"], state["step"])
    else:
      raw = jnp.zeros_like(state["key"]) if kind == "greedy" else fold(state["key"], state["step"])
    keys = jax.random.wrap_key_data(raw)
    tokens, logprobs = sampling.sample(state["logits"], state["temperature"], state["top_k"],
                                       state["top_p"], keys, kind=kind)
    # A slot stops changing once its request has sampled (and fed) a stop id or its last
    # token: what the turn cache keeps is then exactly the conversation's state. The keys and
    # values a finished slot writes land at its `pos`, past its tokens, and are overwritten by
    # whatever comes next; its recurrent states are held by the step itself (`live`: neither
    # decayed nor written) and its `pos` here.
    live = ~state["done"] if self.hold_finished else None
    logits, cache = qwen3_5.decode_step(self.cfg, params, state["cache"], tokens, live=live)
    step = state["step"] + 1
    new_state = dict(state, cache=cache, logits=logits, step=step)
    if self.hold_finished:
      # A live slot served by other weights than its prefix was computed with holds a mixed
      # state, which no next turn may continue from.
      new_state["version"] = jnp.where(live & (state["version"] != version), -1, state["version"])
      new_state["cache"] = dict(cache, pos=jnp.where(live, cache["pos"], state["cache"]["pos"]))
      finished = (tokens[:, None] == state["stop"]).any(axis=1) | (step >= state["budget"])
      new_state["done"] = state["done"] | finished
    data = jnp.stack([tokens, jnp.ones_like(tokens), step], axis=1)  # token, valid, length
    return new_state, data, logprobs[:, None]

  def _score(self, params, tokens):
    """tokens [1, bucket] -> (logprob of each token after the ones before it [bucket] (0 at
    position 0), top-K logprobs and ids [bucket, K] of the distribution at each position).

    The logprobs are the train step's (`rl.train_step.token_logprobs`: the same forward and
    log_softmax of the same logits, temperature 1); the vocabulary-sized logprobs exist for
    SCORE_CHUNK positions at a time.
    """
    hidden, _ = qwen3_5.forward_hidden(self.cfg, params, tokens)
    h, y = hidden[0, :-1], tokens[0, 1:]
    k = min(TOP_LOGPROBS, self.cfg.vocab_size)

    def block(a):
      h, y = a
      logp = jax.nn.log_softmax(qwen3_5.logits_from_hidden(self.cfg, params, h), axis=-1)
      top_lp, top_ids = jax.lax.top_k(logp, k)
      return jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0], top_lp, top_ids

    t = y.shape[0]
    if t <= SCORE_CHUNK:
      lp, top_lp, top_ids = block((h, y))
    else:
      n = -(-t // SCORE_CHUNK)
      pad = n * SCORE_CHUNK - t
      blocks = (jnp.pad(h, [(0, pad), (0, 0)]).reshape(n, SCORE_CHUNK, -1),
                jnp.pad(y, [(0, pad)]).reshape(n, SCORE_CHUNK))
      lp, top_lp, top_ids = (x.reshape((n * SCORE_CHUNK,) + x.shape[2:])[:t]
                             for x in jax.lax.map(block, blocks))
    first = lambda x, v: jnp.concatenate([jnp.full((1,) + x.shape[1:], v, x.dtype), x])
    return first(lp, 0), first(top_lp, 0), first(top_ids, 0)
