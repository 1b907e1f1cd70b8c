"""The Qwen3.5 engine for JetStream 0.2.2: prefill, insert, generate over fixed decode slots.

    engine = QwenEngine.from_config(config)           # random init, or params=...
    handle = engine.load_params()                      # what the Driver holds
    prefix = engine.prefill(params=handle, padded_tokens=PrefillInput(...), true_length=n)
    state = engine.insert(prefix, engine.init_decode_state(), slot=0)
    state, result = engine.generate(handle, state)     # one token for every slot
    engine.update_params(new_params)                   # weight sync; no restart, no recompile

With LoRA (`lora_spec`, from lora.rank > 0) the engine serves a frozen base plus adapters: the
params it is built with are the base, and a weight sync sends the adapters alone
(models/lora.py), which the engine merges into its served weights, W + (alpha / r) A @ B from
the base it keeps. Merged once per sync, decoding runs the plain model: applying the adapters
in every decode step (merging each layer, or x @ A @ B beside each projection) would add to
each step, memory-bound at decode batch sizes, work a sync pays once (docs/lora.md). The cost
is the memory of the adapted weights twice (base and served).

Decode state (one row per slot):
  cache        the model's decode cache (qwen3_5.init_cache): KV [cycles, slots, max_len, kv, hd]
               for the attention layers, conv [cycles, slots, k-1, conv] + ssm [cycles, slots,
               v_heads, dk, dv] f32 for the Gated DeltaNet layers; "pos" [slots] int32.
  logits       [slots, vocab] f32, the next-token logits of each slot.
  key          [slots, 2] uint32 raw PRNG key of the request; the draw at step s uses
               fold_in(key, s), so a request samples the same ids in any slot or batch.
  step         [slots] int32, tokens sampled so far.
  temperature, top_p [slots] f32; top_k [slots] int32: the request's sampling settings.

JetStream 0.2.2's prefill returns only the prefix (no first token), so the prefix carries the
last prompt position's logits and `generate` samples first, then feeds the sampled token
through the model: every step emits exactly one token per slot, the first included, and the
sampling code lives in one place.

With prefix buckets (`rollout.prefix_cache`), a prompt that extends the prefix all prompts share
(the system turn; learned by rl/rollout/prefix_cache.py) is prefilled from that prefix's cached
state on: the prefix costs one prefill per weights version instead of one per prompt.

With a turn cache (`rollout.turn_cache` > 0; rl/rollout/turn_cache.py) a request that ends keeps
its slot's state, and the conversation's next prompt is prefilled from it: only the tokens after
the last turn. For that, a slot whose request has sampled a stop id or its max_tokens stops
changing (`done`): JetStream's generate loop keeps stepping every slot, and the detokenize
thread sees a finished request a step or more late, by which time a recurrent (Gated DeltaNet)
state would have moved on past the turn's end. The kept state is copied out of the decode
state before the slot takes a new request (`keep_turn`, drained under the state lock by
`insert` and `prefill`).

The engine holds its weights (their handle, dtypes, placement, the LoRA merge) in an
`EngineWeights` (rl/rollout/engine_weights.py) and the caches' bookkeeping in an
`EngineCaches` (rl/rollout/engine_caches.py), and runs the programs itself; the tokenizer
JetStream asks it for is rl/rollout/engine_tokenizer.py's.

Results are `SampledTokens`: JetStream's `ResultTokens` (token, valid, length columns)
extended with the logprob of each token; stop ids and max_tokens are applied per request by
the orchestrator (rl/rollout/orchestrator.py), which also returns the stop id itself.
"""
import dataclasses
import threading
import types
from typing import Any, Optional, Sequence

from rl.rollout import compat  # noqa: F401  (must run before JetStream's orchestrator is used)

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jetstream.engine import engine_api
from jetstream.engine import tokenizer_api
from jetstream.engine import tokenizer_pb2

from models import lora
from models import qwen3_5
from models import sharding
from models.layers import gated_deltanet
from rl.rollout import capacity
from rl.rollout import engine_caches
from rl.rollout import engine_tokenizer
from rl.rollout import engine_weights
from rl.rollout import sampling
from rl.rollout.engine_weights import ParamsHandle


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  """Per-request sampler settings (temperature 0 = greedy; seed None = engine's own)."""
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: Optional[int] = None


# Alternatives `score` returns at each prompt position (the most `top_logprobs` a request gets).
TOP_LOGPROBS = 20
# Prompt positions whose vocabulary-sized logprobs `score` holds at once.
SCORE_CHUNK = 256

# Stop ids a slot can watch for on the device (the freeze of a finished slot's state); a request
# with more is served as before, its turn not kept.
MAX_STOP_IDS = 8


@dataclasses.dataclass(frozen=True)
class PrefillInput:
  """What the orchestrator hands `prefill` as `padded_tokens`: ids padded to a bucket + sampling.

  JetStream's prefill signature has no room for request settings, so they travel with the
  tokens. A bare array is accepted too (engine default sampling).
  """
  tokens: np.ndarray           # [bucket] int32, valid on [0, true_length)
  sampling: SamplingSettings
  stop_ids: Optional[tuple] = None  # the request's stop ids (its slot's state freezes at one); None = the engine's
  max_tokens: int = 0          # the request's token budget; 0 = until the slot is full


@dataclasses.dataclass
class PromptScores:
  """What `QwenEngine.score` returns for a prompt of n ids: the model's distribution (softmax of
  the raw logits, temperature 1) at every prompt position, given the ids before it.

  logprobs [n] f32: the logprob of ids[i] after ids[:i]; logprobs[0] = 0 (no context, as the
    train step's `token_logprobs`, which this equals).
  top_ids [n, K] int32, top_logprobs [n, K] f32: the K = min(TOP_LOGPROBS, vocab) likeliest ids
    at position i (after ids[:i]), likeliest first; row 0 is meaningless.
  version: the weights version that scored it.
  """
  logprobs: np.ndarray
  top_ids: np.ndarray
  top_logprobs: np.ndarray
  version: int


@struct.dataclass
class SampledTokens(engine_api.ResultTokens):
  """JetStream's ResultTokens plus the logprob of each sampled token.

  data [slots, 3] int32 = (token, valid, length); logprobs [slots, 1] float32.
  """
  logprobs: Any = None

  def copy_to_host_async(self) -> None:
    for x in (self.data, self.logprobs):
      if isinstance(x, jax.Array):
        x.copy_to_host_async()

  def convert_to_numpy(self) -> "SampledTokens":
    return SampledTokens(np.asarray(self.data), self.tokens_idx, self.valid_idx,
                         self.length_idx, self.samples_per_slot, np.asarray(self.logprobs))


def _split_seed(seed: int) -> tuple[np.uint32, np.uint32]:
  seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
  return np.uint32(seed & 0xFFFF_FFFF), np.uint32(seed >> 32)


def engine_mesh(config, devices: Optional[Sequence[Any]] = None):
  """(mesh, logical-axis rules) of the engine, or (None, None) for one device.

  `devices`: the process's devices to build it over (default: jax.local_devices(); the compile
  mode passes one host's compile-only devices of a target, rl/compile_job.py).

  `rollout.mesh_shape` over `mesh.axes` with `mesh.rules`, across all devices; () = `mesh.shape`:
  in the default layout the engine lives in the trainer's process on the trainer's devices, and
  with the train step's own layout a weight sync copies each shard on its device. A rollout server
  in its own job (`--mode=serve`) sets the shape of its own devices; a shape without -1 takes the
  first devices it needs. In a multi-process job each process's engine lives on that process's
  own devices. Raises `models.sharding.MeshError` when the shape needs more devices than there
  are.
  """
  # Each process of a multi-process job serves its own episodes from an engine on its own
  # devices (the trainer's process-local devices; one process: all of them).
  local = list(jax.local_devices() if devices is None else devices)
  try:
    shape = capacity.engine_mesh_shape(config, len(local))
    # A shape without -1 may take the first of more devices (one for a small model).
    wanted = min(int(np.prod(shape)), len(local))
    resolved = sharding.resolve_mesh_shape(config.mesh.axes, shape, wanted)
  except sharding.MeshError as e:
    raise sharding.MeshError(f"rollout engine: {e} (set rollout.mesh_shape)") from e
  if int(np.prod(resolved)) == 1:
    return None, None
  mesh = sharding.make_mesh(types.SimpleNamespace(axes=tuple(config.mesh.axes), shape=resolved),
                            devices=local[:wanted])
  # Context parallelism is for the train step's long rows; the engine keeps whole rows.
  return mesh, sharding.without_context_parallel(config.mesh.rules)


class QwenEngine(engine_api.Engine):
  """JetStream engine for the Qwen3.5 model (models/qwen3_5.py).

  Args:
    cfg: the model config (qwen3_5.config_from_dict).
    slots: decode slots = max_concurrent_decodes.
    max_len: tokens per slot (prompt + sampled).
    prefill_buckets: prompt pad lengths, ascending; those above max_len are dropped.
    params: parameter tree; None = random init from `init_seed`.
    default_sampling: settings of requests that bring none.
    stop_ids: default stop ids (reported to JetStream's tokenizer; per-request ones win).
    cache_dtype: KV / conv dtype; None = the model's activation dtype.
    tokenizer_cfg: the `tokenizer` config section (for text requests); None = none.
    mesh, rules: optional device mesh and logical-axis rules (models/sharding.py); None = one
      device.
    prefix_buckets: pad lengths of the part of a prompt after the shared prefix (one compile
      each, at first use); () = no prefix cache: every prompt is prefilled whole.
    prefix_min_len: the shortest shared prefix worth caching (rl/rollout/prefix_cache.py).
    initial_version: the version the first params are served as (responses report it).
    turn_cache: finished turns whose slot state is kept for the conversation's next prompt
      (rl/rollout/turn_cache.py); 0 = none.
    weights_dtype: dtype the engine holds its weight matrices in
      (engine_weights.serving_shapes); params in another float dtype (float32 master weights)
      are cast on the way in. None = as given.
    abstract_on: None, or a (compile-only) device: then the engine holds no weights, only their
      shapes and shardings (on its mesh, or on this device without one); it cannot serve, only
      `lower_programs` (the compile mode, rl/compile_job.py).
    lora_spec: a models.lora.LoraSpec: `params` are the frozen base, and `update_params` takes
      adapters, merged into the served weights; None = weight syncs send whole params.
  """

  def __init__(self, cfg, *, slots: int, max_len: int, prefill_buckets: Sequence[int],
               params=None, init_seed: int = 0, default_sampling: SamplingSettings = SamplingSettings(),
               stop_ids: Sequence[int] = (), cache_dtype: Optional[str] = None, tokenizer_cfg=None,
               mesh=None, rules=None, prefix_buckets: Sequence[int] = (), prefix_min_len: int = 256,
               initial_version: int = 0, turn_cache: int = 0,
               weights_dtype: Optional[str] = None, abstract_on: Optional[Any] = None,
               lora_spec: Optional[lora.LoraSpec] = None):
    if max_len > cfg.max_position_embeddings:
      raise ValueError(f"max_len {max_len} > model max_position_embeddings "
                       f"{cfg.max_position_embeddings}")
    self.cfg = cfg
    self.slots = int(slots)
    self.max_len = int(max_len)
    buckets = sorted({int(b) for b in prefill_buckets if 0 < int(b) < self.max_len})
    # The largest prompt leaves room for one sampled token.
    if not buckets or buckets[-1] < self.max_len - 1:
      buckets.append(self.max_len - 1)
    self.buckets = tuple(buckets)
    self.default_sampling = default_sampling
    self.stop_ids = tuple(int(i) for i in stop_ids)
    self.cache_dtype = jnp.dtype(cache_dtype or cfg.dtype)
    self._tokenizer_cfg = tokenizer_cfg
    self._mesh = mesh
    self._rules = rules
    self._seed_lock = threading.Lock()
    self._seed_counter = np.random.default_rng(init_seed).integers(1 << 62)
    self._abstract_on = abstract_on
    self._weights = engine_weights.EngineWeights(
        cfg, params, init_seed=init_seed, weights_dtype=weights_dtype, mesh=mesh, rules=rules,
        abstract_on=abstract_on, lora_spec=lora_spec, initial_version=initial_version)
    self._caches = engine_caches.EngineCaches(
        buckets=self.buckets, max_len=self.max_len, prefix_buckets=prefix_buckets,
        align=gated_deltanet.chunk_size(cfg), prefix_min_len=prefix_min_len,
        turn_cache=turn_cache)
    self.prompt_tokens = 0     # prompt tokens requests brought
    self.prefilled_tokens = 0  # of them, those prefill computed (not read from a cached state)
    self._prefill_jit = jax.jit(self._prefill_impl)
    self._extend_jit = jax.jit(self._extend_impl)
    # Not donated: the kept KV is cut to key_len, so its buffers could not hold the result.
    self._append_jit = jax.jit(self._append_impl, static_argnames=("key_len",))
    self._insert_jit = jax.jit(self._insert_impl, donate_argnums=(1,))
    self._generate_jit = jax.jit(self._generate_impl, donate_argnums=(1,))
    self._score_jit = jax.jit(self._score_impl)

  @classmethod
  def from_config(cls, config, params=None, devices: Optional[Sequence[Any]] = None,
                  **overrides) -> "QwenEngine":
    """Builds the engine from the `model`, `rollout`, `tokenizer`, `mesh` and `seed` sections.
    `devices`: one process's devices for its mesh (`engine_mesh`); compile-only ones give an
    abstract engine (`abstract_on`), for `lower_programs` alone."""
    r = config.rollout
    cfg = qwen3_5.config_from_dict(config.model)
    mesh, rules = engine_mesh(config, devices)
    if devices is not None:
      overrides.setdefault("abstract_on", devices[0])
    kw = dict(
        slots=capacity.engine_slots(config, len(devices) if devices is not None else 0),
        max_len=r.max_len, prefill_buckets=r.prefill_buckets,
        params=params, init_seed=config.seed,
        default_sampling=SamplingSettings(r.temperature, r.top_p, r.top_k, None),
        stop_ids=r.stop_ids, cache_dtype=r.cache_dtype or None, tokenizer_cfg=config.tokenizer,
        prefix_buckets=r.prefix_buckets if r.prefix_cache else (),
        prefix_min_len=r.prefix_min_len, turn_cache=r.turn_cache, mesh=mesh, rules=rules,
        weights_dtype=r.weights_dtype or None,
        lora_spec=lora.from_config(config.lora) if "lora" in config else None)
    kw.update(overrides)
    return cls(cfg, **kw)

  # -- the jitted computations --------------------------------------------------------------

  def _ctx(self):
    return engine_weights.mesh_context(self._mesh, self._rules)

  # `request` below: (seed_lo, seed_hi, temperature, top_k, top_p, stop [K], budget, version),
  # the request's own settings, which travel with its prefix into the slot.

  def _prefill_impl(self, params, tokens, length, *request):
    """tokens [1, bucket] int32, length [1] int32 -> prefix (KV length = bucket)."""
    # KV length = bucket: a short prompt's prefix stays small; insert pads it to max_len.
    logits, cache = qwen3_5.prefill(self.cfg, params, tokens, length, tokens.shape[1])
    return self._prefix(logits, cache, *request)

  def _extend_impl(self, params, prefix_cache, tokens, length, *request):
    """The shared prefix's cache (KV length P) + tokens [1, bucket] after it -> prefix (KV length
    P + bucket)."""
    logits, cache = qwen3_5.prefill_extend(self.cfg, params, prefix_cache, tokens, length)
    return self._prefix(logits, cache, *request)

  def _append_impl(self, params, turn_cache, tokens, length, *request, key_len: int):
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

  def _insert_impl(self, prefix, state, slot):
    cache = qwen3_5.cache_insert(state["cache"], prefix["cache"], slot)
    put = lambda dst, src: jax.lax.dynamic_update_index_in_dim(dst, src.astype(dst.dtype), slot, 0)
    out = {"cache": cache, "step": put(state["step"], jnp.zeros((1,), jnp.int32)),
           "done": put(state["done"], jnp.zeros((1,), bool))}
    for name in ("logits", "key", "temperature", "top_k", "top_p", "stop", "budget", "version"):
      out[name] = put(state[name], prefix[name])
    return out

  def _generate_impl(self, params, state, version):
    # Each row's key for this step; a batch of greedy rows draws nothing (sampling.sample) and
    # skips the derivation too.
    fold = jax.vmap(lambda k, s: jax.random.key_data(
        jax.random.fold_in(jax.random.wrap_key_data(k), s)))
    keys = jax.random.wrap_key_data(jax.lax.cond(
        jnp.all(state["temperature"] <= 0), lambda k, s: jnp.zeros_like(k), fold,
        state["key"], state["step"]))
    tokens, logprobs = sampling.sample(state["logits"], state["temperature"], state["top_k"],
                                       state["top_p"], keys)
    logits, cache = qwen3_5.decode_step(self.cfg, params, state["cache"], tokens)
    step = state["step"] + 1
    new_state = dict(state, cache=cache, logits=logits, step=step)
    if self._caches.keeps_turns:
      live = ~state["done"]
      # A live slot served by other weights than its prefix was computed with holds a mixed
      # state, which no next turn may continue from.
      new_state["version"] = jnp.where(live & (state["version"] != version), -1, state["version"])
      # A slot stops changing once its request has sampled (and fed) a stop id or its last
      # token: what the turn cache keeps is then exactly the conversation's state. The keys
      # and values a finished slot writes land at its `pos`, past its tokens, and are
      # overwritten by whatever comes next; only the recurrent state and `pos` must hold.
      def hold(new, old):
        shape = (1, live.shape[0]) + (1,) * (new.ndim - 2)
        return jnp.where(live.reshape(shape), new, old)
      blocks = tuple({k: (v if k in ("k", "v") else hold(v, old[k])) for k, v in b.items()}
                     for b, old in zip(cache["blocks"], state["cache"]["blocks"]))
      new_state["cache"] = {"pos": jnp.where(live, cache["pos"], state["cache"]["pos"]),
                            "blocks": blocks}
      finished = (tokens[:, None] == state["stop"]).any(axis=1) | (step >= state["budget"])
      new_state["done"] = state["done"] | finished
    data = jnp.stack([tokens, jnp.ones_like(tokens), step], axis=1)  # token, valid, length
    return new_state, data, logprobs[:, None]

  def _score_impl(self, params, tokens):
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

  def score(self, ids: Sequence[int]) -> PromptScores:
    """The model's logprob of each of `ids` after the ones before it, and the likeliest ids at
    each position, under the weights served now (one forward of the prompt padded to its
    prefill bucket; no slot is used). For echo / prompt logprobs (the OpenAI front) and
    scoring. Thread-safe beside the serving threads."""
    if self._abstract_on is not None:
      raise RuntimeError("an abstract engine (compile mode) cannot score")
    ids = [int(i) for i in ids]
    weights, version = self._weights.handle.get()
    with self._ctx():
      lp, top_lp, top_ids = self._score_jit(weights, self.pad_prompt(ids)[None])
    n = len(ids)
    return PromptScores(np.asarray(lp)[:n], np.asarray(top_ids)[:n],
                        np.asarray(top_lp)[:n], version)

  # -- JetStream's Engine API ---------------------------------------------------------------

  def load_params(self, *args, **kwargs) -> ParamsHandle:
    """The handle JetStream's Driver holds; `update_params` swaps what it points to."""
    del args, kwargs
    return self._weights.handle

  def update_params(self, params, version: Optional[int] = None) -> int:
    """Weight sync: the next prefill / generate step uses `params`. Returns the new version.

    The tree must match the engine's (structure, shapes; floats are cast to the engine's
    dtypes) so that nothing recompiles; the arrays are placed on the engine's devices (a
    reshard when they come from a training mesh). With LoRA, `params` are the adapters, merged
    into the kept base (rl/rollout/engine_weights.py).
    """
    served = self._weights.served(params)
    self._caches.clear_turns()   # computed under the old weights: a next turn would not use them
    return self._weights.handle.swap(served, version)

  def sync_target(self):
    """What `update_params` takes, as ShapeDtypeStructs with their shardings (a restore target
    for a published version, rl/rollout/published_weights.py): `params_target`, or with LoRA
    the adapters (float32)."""
    return self._weights.sync_target()

  def params_target(self):
    """The engine's params as ShapeDtypeStructs with their shardings: a restore target that
    puts each shard of a saved tree straight on the device that serves it."""
    return self._weights.params_target()

  @property
  def params_version(self) -> int:
    return self._weights.version

  @property
  def last_sync_bytes(self) -> int:
    """Bytes the last weight sync brought (adapters or whole params)."""
    return self._weights.last_sync_bytes

  def next_seed(self) -> int:
    """A fresh sampler seed for requests that bring none."""
    with self._seed_lock:
      self._seed_counter += 1
      return int(self._seed_counter)

  def bucket_for(self, n: int) -> int:
    for b in self.buckets:
      if n <= b:
        return b
    raise ValueError(f"prompt of {n} tokens exceeds the largest prefill bucket {self.buckets[-1]}")

  def pad_prompt(self, ids: Sequence[int]) -> np.ndarray:
    tokens = np.zeros((self.bucket_for(len(ids)),), np.int32)
    tokens[:len(ids)] = ids
    return tokens

  def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int):
    """Runs the prompt; returns the prefix (cache, last logits, the request's settings)."""
    if existing_prefix is not None:
      raise NotImplementedError("JetStream's existing_prefix is not supported; the engine "
                                "caches the prefix prompts share itself (rollout.prefix_cache)")
    stop_ids, max_tokens = self.stop_ids, 0
    if isinstance(padded_tokens, PrefillInput):
      tokens, s = padded_tokens.tokens, padded_tokens.sampling
      if padded_tokens.stop_ids is not None:
        stop_ids = padded_tokens.stop_ids
      max_tokens = padded_tokens.max_tokens
    else:
      tokens, s = np.asarray(padded_tokens), self.default_sampling
    tokens = np.asarray(tokens, np.int32).reshape(1, -1)
    seed = self.next_seed() if s.seed is None else s.seed
    lo, hi = _split_seed(seed)
    stop = np.full((MAX_STOP_IDS,), -1, np.int32)
    stop[:min(len(stop_ids), MAX_STOP_IDS)] = list(stop_ids)[:MAX_STOP_IDS]
    budget = np.int32(max_tokens if max_tokens > 0 else self.max_len)
    if isinstance(params, ParamsHandle):
      weights, version = params.get()   # one read: every part of the prompt sees one version
    else:
      weights, version = params, -1
    request = (lo, hi, np.float32(s.temperature), np.int32(s.top_k), np.float32(s.top_p), stop,
               budget, np.int32(version))
    prompt = tokens[0, :true_length]
    self.prompt_tokens += int(true_length)
    with self._ctx():
      out = self._prefill_from_cache(weights, version, prompt, request) if version >= 0 else None
      if out is not None:
        return out
      self.prefilled_tokens += int(true_length)
      return self._prefill_jit(weights, tokens, np.asarray([true_length], np.int32), *request)

  def _prefill_from_cache(self, params, version: int, prompt: np.ndarray, request):
    """The prompt's prefix from a cached state it extends and a prefill of only the tokens
    after it: a kept turn's (its slot state, written in place), else the shared prefix's;
    None when neither serves it (rl/rollout/engine_caches.py says when)."""
    hit = self._caches.after_turn(prompt, version) if self._caches.keeps_turns else None
    if hit is not None:
      self.prefilled_tokens += hit.rest
      return self._append_jit(params, hit.cache, hit.tokens, hit.length, *request,
                              key_len=hit.key_len)
    if not self._caches.shares_prefix:
      return None
    no_request = (np.uint32(0), np.uint32(0), np.float32(1.0), np.int32(0), np.float32(1.0),
                  np.full((MAX_STOP_IDS,), -1, np.int32), np.int32(0), np.int32(version))
    compute = lambda t: self._prefill_jit(params, t[None], np.asarray([len(t)], np.int32),
                                          *no_request)["cache"]
    hit = self._caches.after_shared(prompt, version, compute)
    if hit is None:
      return None
    self.prefilled_tokens += hit.rest
    return self._extend_jit(params, hit.cache, hit.tokens, hit.length, *request)

  # -- kept turns and cache stats (rl/rollout/engine_caches.py) -----------------------------

  @property
  def keeps_turns(self) -> bool:
    return self._caches.keeps_turns

  def keep_turn(self, slot: int, tokens: Sequence[int]) -> None:
    """Slot `slot`'s request has ended and its state holds `tokens` (prompt and every sampled
    token): keep that state for the conversation's next prompt. Call before the slot is freed;
    the copy is taken before the slot's next insert."""
    self._caches.keep_turn(slot, tokens)

  def turn_cache_stats(self) -> dict:
    """The turn cache's counts (`EngineCaches.turn_stats`); {} without one."""
    return self._caches.turn_stats()

  def prefix_cache_stats(self) -> dict:
    """The shared prefix's counts (`EngineCaches.prefix_stats`); {} without one."""
    return self._caches.prefix_stats()

  def insert(self, prefix, decode_state, slot: int):
    insert = lambda: self._insert_jit(prefix, decode_state, np.int32(slot))
    with self._ctx():
      if not self._caches.keeps_turns:
        return insert()
      return self._caches.run_insert(insert)

  def generate(self, params, decode_state):
    if isinstance(params, ParamsHandle):
      weights, version = params.get()
    else:
      weights, version = params, -1
    step = lambda: self._generate_jit(weights, decode_state, np.int32(version))
    with self._ctx():
      if not self._caches.keeps_turns:
        state, data, logprobs = step()
      else:
        state, data, logprobs = self._caches.run_generate(step)
    return state, SampledTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                                samples_per_slot=1, logprobs=logprobs)

  def init_decode_state(self, *args, **kwargs):
    del args, kwargs
    if self._abstract_on is not None:
      raise RuntimeError("an abstract engine (compile mode) holds no state; use lower_programs")
    return self._decode_state()

  def _decode_state(self, abstract: bool = False):
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
    if self._mesh is not None:
      cache_sh = sharding.tree_shardings(qwen3_5.cache_axes(self.cfg), shapes["cache"],
                                         self._mesh, self._rules)
      rest = {k: sharding.batch_sharding(self._mesh, self._rules, x.ndim, b)
              for k, x in shapes.items() if k != "cache"}
      where = dict(rest, cache=cache_sh)
    else:
      where = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(
          self._abstract_on or jax.local_devices()[0]), shapes)
    if abstract:
      return sharding.with_shardings(shapes, where)
    state = make()
    return jax.device_put(state, where) if self._mesh is not None else state

  def lower_programs(self, buckets: Optional[Sequence[int]] = None) -> dict:
    """name -> `jax.stages.Lowered` of the programs serving runs: a prefill and an insert per
    prompt bucket (default: every bucket) and the generate step, for abstract inputs of the
    shapes and shardings serving gives them. Nothing runs and nothing is allocated."""
    params = self.params_target()
    state = self._decode_state(abstract=True)
    one = (self._mesh and sharding.replicated(self._mesh)) or jax.sharding.SingleDeviceSharding(
        self._abstract_on or jax.local_devices()[0])
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=one)
    request = (sds((), jnp.uint32), sds((), jnp.uint32), sds((), jnp.float32), sds((), jnp.int32),
               sds((), jnp.float32), sds((MAX_STOP_IDS,), jnp.int32), sds((), jnp.int32),
               sds((), jnp.int32))
    out = {}
    with self._ctx():
      for b in buckets or self.buckets:
        prefill = self._prefill_jit.lower(params, sds((1, b), jnp.int32), sds((1,), jnp.int32),
                                          *request)
        out[f"prefill_{b}"] = prefill
        prefix = jax.tree.map(lambda x: sds(x.shape, x.dtype), prefill.out_info)
        out[f"insert_{b}"] = self._insert_jit.lower(prefix, state, sds((), jnp.int32))
      out["generate"] = self._generate_jit.lower(params, state, sds((), jnp.int32))
    return out

  def warmup(self, buckets: Optional[Sequence[int]] = None, prefix: Optional[Sequence[int]] = None,
             score: bool = False) -> None:
    """Compiles every program serving runs, so that no request waits for a compile: a prefill
    for each bucket, each prefill's insert into a new decode state (the driver's first insert
    meets one) and into one that has been through insert and generate (every later insert: jit
    compiles the two apart), and the generate step.

    `prefix`: ids prompts are known to open with (the system turn of the served tools,
    `serve.system_turn`). With the shared-prefix cache it becomes the prefix (`SharedPrefix.prime`),
    its cache is computed, and the programs of prompts that extend it are compiled too: the
    prefill of the prefix, its extension by each prefix bucket, and their inserts. Without it
    those compile at the first prompts that share a prefix (its length is known only then).
    `score`: also `score`'s program for each bucket (the OpenAI front's echo).
    """
    buckets = tuple(buckets or self.buckets)
    counts = (self.prompt_tokens, self.prefilled_tokens)
    prefixes = [self.prefill(params=self._weights.handle, padded_tokens=PrefillInput(
        np.zeros((b,), np.int32), SamplingSettings(seed=0)), true_length=1) for b in buckets]
    if prefix is not None and self._caches.shares_prefix:
      prefixes += self._warm_shared_prefix(prefix)
    for p in prefixes:   # into a new decode state
      jax.block_until_ready(self.insert(p, self.init_decode_state(), 0)["step"])
    state = self.insert(prefixes[0], self.init_decode_state(), 0)
    state, _ = self.generate(self._weights.handle, state)
    for p in prefixes:   # into a state that has been through insert and generate
      state = self.insert(p, state, 0)
    state, result = self.generate(self._weights.handle, state)
    jax.block_until_ready(result.data)
    if score:
      for b in buckets:
        self.score(np.zeros((b,), np.int32))
    # Warmup's prompts are not requests: the counters stay as they were.
    self.prompt_tokens, self.prefilled_tokens = counts

  def _warm_shared_prefix(self, prefix: Sequence[int]) -> list:
    """Primes the shared prefix with `prefix` and prefills, through the serving path, one
    prompt extending it per prefix bucket (computing the prefix's cache on the way). Returns
    their prefixes (for the inserts); [] when `prefix` is too short to be cached."""
    prefill = lambda prompt: self.prefill(params=self._weights.handle, padded_tokens=PrefillInput(
        self.pad_prompt(prompt), SamplingSettings(seed=0)), true_length=len(prompt))
    return self._caches.warm_shared(prefix, prefill)

  def get_prefix_destination_sharding(self) -> Any:
    return None  # one engine does both prefill and generate (interleaved mode)

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    path = "" if self._tokenizer_cfg is None else self._tokenizer_cfg.path
    return tokenizer_pb2.TokenizerParameters(path=path)

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> tokenizer_api.Tokenizer:
    del metadata
    return engine_tokenizer.for_engine(self._tokenizer_cfg, self.stop_ids)

  @property
  def max_concurrent_decodes(self) -> int:
    return self.slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self.buckets[-1]

  @property
  def mesh(self) -> jax.sharding.Mesh:
    if self._mesh is None:
      return jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("x",))
    return self._mesh

  @property
  def colocated_cpus(self):
    return None

