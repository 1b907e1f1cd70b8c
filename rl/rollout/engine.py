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

JetStream 0.2.2's prefill returns only the prefix (no first token), so the prefix carries the
last prompt position's logits and `generate` samples first: every step emits exactly one token
per slot.

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
`EngineWeights` (rl/rollout/engine_weights.py), the caches' bookkeeping in an `EngineCaches`
(rl/rollout/engine_caches.py) and its programs (prefill, insert, generate, score, and the decode
state of one row per slot they run on) in an `EnginePrograms` (rl/rollout/engine_programs.py);
the tokenizer JetStream asks it for is
rl/rollout/engine_tokenizer.py's.

The prefix and the decode state carry one entry the device never sees, `SAMPLER_ROWS`: each
row's sampler flags on the host (greedy; filters by top-k or top-p), from the request's
settings at prefill. `generate` picks the sampler's kind from them (sampling.kind_of), one
program per kind: a branch on the device would make XLA:GPU stop the host at every step.

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
import numpy as np
from flax import struct
from jetstream.engine import engine_api
from jetstream.engine import tokenizer_api
from jetstream.engine import tokenizer_pb2

from configs import validate
from models import lora
from models import qwen3_5
from models import sharding
from models.layers import gated_deltanet
from rl.rollout import capacity
from rl.rollout import engine_caches
from rl.rollout import engine_programs
from rl.rollout import engine_tokenizer
from rl.rollout import engine_weights
from rl.rollout import sampling
from rl.rollout.engine_weights import ParamsHandle

# The host entry of a prefix ([2] bool) and of a decode state ([slots, 2] bool): each row's
# (greedy; filters: top-k or top-p set) flags, from which `generate` picks the sampler's kind.
SAMPLER_ROWS = "sampler_rows"


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  """Per-request sampler settings (temperature 0 = greedy; seed None = engine's own)."""
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: Optional[int] = None

  def sampler_row(self) -> np.ndarray:
    """[greedy, filters]: the flags `SAMPLER_ROWS` holds for a request of these settings
    (sampling.kind_of ignores a greedy row's filter)."""
    return np.asarray([self.temperature <= 0, self.top_k > 0 or self.top_p < 1.0])


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

  @classmethod
  def of(cls, padded_tokens, default: SamplingSettings) -> "PrefillInput":
    """`padded_tokens` as a PrefillInput: itself, or bare ids with `default` sampling."""
    if isinstance(padded_tokens, cls):
      return padded_tokens
    return cls(np.asarray(padded_tokens), default)


@dataclasses.dataclass
class PromptScores:
  """What `QwenEngine.score` returns for a prompt of n ids: the model's distribution (softmax of
  the raw logits, temperature 1) at every prompt position, given the ids before it.

  logprobs [n] f32: the logprob of ids[i] after ids[:i]; logprobs[0] = 0 (no context, as the
    train step's `token_logprobs`, which this equals).
  top_ids [n, K] int32, top_logprobs [n, K] f32: the K = min(TOP_LOGPROBS, vocab) likeliest
    ids at position i (after ids[:i]; rl/rollout/engine_programs.py), likeliest first; row 0 is
    meaningless.
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


def _on_device(tree: dict) -> dict:
  """A prefix or decode state without its host entry: what the device programs take."""
  return {k: v for k, v in tree.items() if k != SAMPLER_ROWS}


def _read(params) -> tuple:
  """(weights, version) of what JetStream passes as `params`: the engine's handle (read once), or
  a bare tree (version -1)."""
  if isinstance(params, ParamsHandle):
    return params.get()
  return params, -1


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
  return mesh, capacity.engine_rules(config)


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
    sampler_choice: "host" (the sampler's kind picked from the slots' settings, a generate
      program each) or "device" (one program that chooses with `lax.cond`s: XLA:GPU waits on
      the host at each; kept to measure that against).
    scan_layers: hold the weights stacked and run the layers as a scan (True), or hold them
      layer by layer and run the model unscanned (False: decode reads each layer's weights in
      place, compile time grows with depth; engine_weights.py).
    fuse_projections: hold each Gated DeltaNet layer's four input projections as one matrix
      (one matmul a decode step; engine_weights.py); False = as trained.
  """

  def __init__(self, cfg, *, slots: int, max_len: int, prefill_buckets: Sequence[int],
               params=None, init_seed: int = 0, default_sampling: SamplingSettings = SamplingSettings(),
               stop_ids: Sequence[int] = (), cache_dtype: Optional[str] = None, tokenizer_cfg=None,
               mesh=None, rules=None, prefix_buckets: Sequence[int] = (), prefix_min_len: int = 256,
               initial_version: int = 0, turn_cache: int = 0,
               weights_dtype: Optional[str] = None, abstract_on: Optional[Any] = None,
               lora_spec: Optional[lora.LoraSpec] = None, scan_layers: bool = True,
               sampler_choice: str = "host", fuse_projections: bool = True):
    if max_len > cfg.max_position_embeddings:
      raise ValueError(f"max_len {max_len} > model max_position_embeddings "
                       f"{cfg.max_position_embeddings}")
    if sampler_choice not in validate.SAMPLER_CHOICES:
      raise ValueError(f"rollout.sampler_choice {sampler_choice!r}: expected one of "
                       f"{validate.SAMPLER_CHOICES}")
    self.cfg = cfg
    self.slots = int(slots)
    self.max_len = int(max_len)
    self.sampler_choice = sampler_choice
    buckets = sorted({int(b) for b in prefill_buckets if 0 < int(b) < self.max_len})
    # The largest prompt leaves room for one sampled token.
    if not buckets or buckets[-1] < self.max_len - 1:
      buckets.append(self.max_len - 1)
    self.buckets = tuple(buckets)
    self.default_sampling = default_sampling
    self.stop_ids = tuple(int(i) for i in stop_ids)
    self._tokenizer_cfg = tokenizer_cfg
    self._seed_lock = threading.Lock()
    self._seed_counter = np.random.default_rng(init_seed).integers(1 << 62)
    self._abstract_on = abstract_on
    self._weights = engine_weights.EngineWeights(
        cfg, params, init_seed=init_seed, weights_dtype=weights_dtype, mesh=mesh, rules=rules,
        abstract_on=abstract_on, lora_spec=lora_spec, initial_version=initial_version,
        scan_layers=scan_layers, fuse_projections=fuse_projections)
    self._caches = engine_caches.EngineCaches(
        buckets=self.buckets, max_len=self.max_len, prefix_buckets=prefix_buckets,
        align=gated_deltanet.chunk_size(cfg), prefix_min_len=prefix_min_len,
        turn_cache=turn_cache)
    # The programs run the model in the layout the weights are held in (unscanned with
    # `scan_layers=False`).
    self.programs = engine_programs.EnginePrograms(
        self._weights.held_cfg, slots=self.slots, max_len=self.max_len,
        cache_dtype=cache_dtype or cfg.dtype, mesh=mesh, rules=rules,
        hold_finished=self._caches.keeps_turns, abstract_on=abstract_on)
    self.prompt_tokens = 0     # prompt tokens requests brought
    self.prefilled_tokens = 0  # of them, those prefill computed (not read from a cached state)

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
        weights_dtype=r.weights_dtype or None, scan_layers=r.scan_layers,
        sampler_choice=r.sampler_choice, fuse_projections=r.fuse_projections,
        lora_spec=lora.from_config(config.lora) if "lora" in config else None)
    kw.update(overrides)
    return cls(cfg, **kw)

  def score(self, ids: Sequence[int]) -> PromptScores:
    """The model's logprob of each of `ids` after the ones before it, and the likeliest ids at
    each position, under the weights served now (one forward of the prompt padded to its
    prefill bucket; no slot is used). For echo / prompt logprobs (the OpenAI front) and
    scoring. Thread-safe beside the serving threads."""
    if self._abstract_on is not None:
      raise RuntimeError("an abstract engine (compile mode) cannot score")
    ids = [int(i) for i in ids]
    weights, version = self._weights.handle.get()
    with self.programs.context():
      lp, top_lp, top_ids = self.programs.score(weights, self.pad_prompt(ids)[None])
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

  def params_target(self, held: bool = False):
    """The engine's params as ShapeDtypeStructs with their shardings: a restore target that
    puts each shard of a saved tree straight on the device that serves it. `held`: in the
    layout the engine holds them (engine_weights.py), not the one a sync brings."""
    return self._weights.params_target(held)

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
    p = PrefillInput.of(padded_tokens, self.default_sampling)
    s, tokens = p.sampling, np.asarray(p.tokens, np.int32).reshape(1, -1)
    weights, version = _read(params)   # one read: every part of the prompt sees one version
    request = engine_programs.request_args(
        version, self.next_seed() if s.seed is None else s.seed, s.temperature, s.top_k, s.top_p,
        self.stop_ids if p.stop_ids is None else p.stop_ids,
        p.max_tokens if p.max_tokens > 0 else self.max_len)
    prompt = tokens[0, :true_length]
    self.prompt_tokens += int(true_length)
    with self.programs.context():
      out = self._prefill_from_cache(weights, version, prompt, request) if version >= 0 else None
      if out is None:
        self.prefilled_tokens += int(true_length)
        out = self.programs.prefill(weights, tokens, np.asarray([true_length], np.int32),
                                    *request)
    return dict(out, **{SAMPLER_ROWS: s.sampler_row()})

  def _prefill_from_cache(self, params, version: int, prompt: np.ndarray, request):
    """The prompt's prefix from a cached state it extends and a prefill of only the tokens
    after it: a kept turn's (its slot state, written in place), else the shared prefix's;
    None when neither serves it (rl/rollout/engine_caches.py says when)."""
    hit = self._caches.after_turn(prompt, version) if self._caches.keeps_turns else None
    if hit is not None:
      self.prefilled_tokens += hit.rest
      return self.programs.append(params, hit.cache, hit.tokens, hit.length, *request,
                                  key_len=hit.key_len)
    if not self._caches.shares_prefix:
      return None
    no_request = engine_programs.request_args(version)
    compute = lambda t: self.programs.prefill(params, t[None], np.asarray([len(t)], np.int32),
                                              *no_request)["cache"]
    hit = self._caches.after_shared(prompt, version, compute)
    if hit is None:
      return None
    self.prefilled_tokens += hit.rest
    return self.programs.extend(params, hit.cache, hit.tokens, hit.length, *request)

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
    rows = np.array(decode_state[SAMPLER_ROWS])
    rows[slot] = np.asarray(prefix[SAMPLER_ROWS])
    insert = lambda: dict(self.programs.insert(_on_device(prefix), _on_device(decode_state),
                                               np.int32(slot)), **{SAMPLER_ROWS: rows})
    with self.programs.context():
      if not self._caches.keeps_turns:
        return insert()
      return self._caches.run_insert(insert)

  def generate(self, params, decode_state):
    weights, version = _read(params)
    rows = decode_state[SAMPLER_ROWS]
    kind = self._sampler_kind(rows[:, 0], rows[:, 1])

    def step():
      state, data, logprobs = self.programs.generate(weights, _on_device(decode_state),
                                                     np.int32(version), kind=kind)
      return dict(state, **{SAMPLER_ROWS: rows}), data, logprobs

    with self.programs.context():
      if not self._caches.keeps_turns:
        state, data, logprobs = step()
      else:
        state, data, logprobs = self._caches.run_generate(step)
    return state, SampledTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3),
                                samples_per_slot=1, logprobs=logprobs)

  def _sampler_kind(self, greedy, filters) -> Optional[str]:
    """The generate program's sampler kind for rows of these flags (None: the device's
    choice, with `sampler_choice="device"`)."""
    return sampling.kind_of(greedy, filters) if self.sampler_choice == "host" else None

  def init_decode_state(self, *args, **kwargs):
    del args, kwargs
    if self._abstract_on is not None:
      raise RuntimeError("an abstract engine (compile mode) holds no state; use lower_programs")
    # An empty slot's settings are the state's defaults (temperature 1, no filter).
    rows = np.tile(SamplingSettings().sampler_row(), (self.slots, 1))
    return dict(self.programs.decode_state(), **{SAMPLER_ROWS: rows})

  def lower_programs(self, buckets: Optional[Sequence[int]] = None) -> dict:
    """name -> `jax.stages.Lowered` of the programs serving runs: a prefill and an insert per
    prompt bucket (default: every bucket) and the generate step of the sampler kind the
    engine's default settings run, for abstract inputs of the shapes and shardings serving gives
    them (`EnginePrograms.lower`). Nothing runs and nothing is allocated."""
    greedy, filters = self.default_sampling.sampler_row()
    return self.programs.lower(self.params_target(held=True), buckets or self.buckets,
                               kind=self._sampler_kind([greedy], [filters]))

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
    prefill = lambda tokens, n: self.prefill(
        params=self._weights.handle, padded_tokens=PrefillInput(tokens, SamplingSettings(seed=0)),
        true_length=n)
    prefixes = [prefill(np.zeros((b,), np.int32), 1) for b in buckets]
    if prefix is not None and self._caches.shares_prefix:
      # One prompt extending the primed prefix per prefix bucket, through the serving path.
      prefixes += self._caches.warm_shared(
          prefix, lambda ids: prefill(self.pad_prompt(ids), len(ids)))
    for p in prefixes:   # into a new decode state
      jax.block_until_ready(self.insert(p, self.init_decode_state(), 0)["step"])
    state = self.insert(prefixes[0], self.init_decode_state(), 0)
    state, _ = self.generate(self._weights.handle, state)
    for p in prefixes:   # into a state that has been through insert and generate
      state = self.insert(p, state, 0)
    state, _ = self.generate(self._weights.handle, state)
    # The generate step of every sampler kind (one program each; `generate` picks one a step).
    weights, version = _read(self._weights.handle)
    state = _on_device(state)
    with self.programs.context():
      for kind in (sampling.KINDS if self.sampler_choice == "host" else (None,)):
        state, data, _ = self.programs.generate(weights, state, np.int32(version), kind=kind)
    jax.block_until_ready(data)
    if score:
      for b in buckets:
        self.score(np.zeros((b,), np.int32))
    # Warmup's prompts are not requests: the counters stay as they were.
    self.prompt_tokens, self.prefilled_tokens = counts

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
    if self.programs.mesh is None:
      return jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("x",))
    return self.programs.mesh

  @property
  def colocated_cpus(self):
    return None

