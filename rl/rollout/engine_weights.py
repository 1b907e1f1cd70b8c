"""The weights a QwenEngine serves (rl/rollout/engine.py): what they are, where they live, and
how a weight sync replaces them.

`EngineWeights` holds the served params behind a `ParamsHandle` (the object JetStream's Driver
holds), in the engine's dtypes (`serving_shapes`) and on the engine's devices. A weight sync
(`served`) checks the new tree against the engine's, so that nothing recompiles, and places a
copy of it, or with LoRA merges the adapters it brings into the base kept from the start:
W + (alpha / r) A @ B, once per sync, so that decoding runs the plain model (docs/lora.md).

A sync brings the trainer's layout (each cycle position's layers stacked); with
`scan_layers=False` the engine holds them layer by layer, in the layout of the model with
`scan_layers=False` (models/qwen3_5.unscan_layers), and its programs run that model: decode then
reads each layer's weights in place where the layer scan copies slices of the stacks
(docs/rollout.md#engine-weights). With `fuse_projections`, each Gated DeltaNet layer's four input
projections are held as one matrix (models/layers/gated_deltanet.fuse_in_projections): a decode
step runs one matmul of them and no per-step concatenation.
"""
import contextlib
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp

from models import lora
from models import qwen3_5
from models import sharding
from models.layers import gated_deltanet


class ParamsHandle:
  """The engine's parameters behind a lock: the object JetStream's Driver holds as `params`.

  The Driver captures its params once per thread, so new weights cannot be handed to it; it
  holds this handle instead and every prefill / generate call reads the current tree. A swap
  takes effect at the next call: a step never mixes two versions.
  """

  def __init__(self, params, version: int = 0):
    self._lock = threading.Lock()
    self._params = params
    self.version = version

  def get(self):
    with self._lock:
      return self._params, self.version

  def swap(self, params, version: Optional[int] = None) -> int:
    with self._lock:
      self._params = params
      self.version = self.version + 1 if version is None else int(version)
      return self.version


def mesh_context(mesh, rules):
  """The context the engine's programs run in: its mesh and logical-axis rules installed, or
  nothing on one device (`mesh` None)."""
  if mesh is None:
    return contextlib.nullcontext()
  return sharding.use_mesh(mesh, rules)


def serving_shapes(shapes, weights_dtype: Optional[str]):
  """The engine's param shapes and dtypes: matrices (embeddings, projections, experts: all but
  a sliver of the bytes) in `weights_dtype`, vectors (norm scales, Gated DeltaNet decay
  parameters: precision-sensitive, tiny) as given. None / "" = every leaf as given."""
  if not weights_dtype:
    return shapes
  dtype = jnp.dtype(weights_dtype)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, dtype if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype),
      shapes)


def _shares_buffers(a, b) -> bool:
  """Whether device arrays `a` and `b` share any device buffer."""
  if not isinstance(a, jax.Array) or not isinstance(b, jax.Array):
    return False
  ptrs = {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
  return any(s.data.unsafe_buffer_pointer() in ptrs for s in b.addressable_shards)


class EngineWeights:
  """The engine's served params: their handle, dtypes and placement, and the weight sync.

  Args:
    cfg: the model config.
    params: parameter tree; None = random init from `init_seed`, where it is served.
    weights_dtype: dtype of the weight matrices (`serving_shapes`); params in another float
      dtype are cast on the way in. None = as given.
    mesh, rules: the engine's device mesh and logical-axis rules; None = one device.
    abstract_on: None, or a (compile-only) device: then only the params' shapes and shardings
      are held (on the mesh, or on this device without one), no arrays.
    lora_spec: a models.lora.LoraSpec: `params` are the frozen base and a sync brings adapters;
      None = a sync brings whole params.
    initial_version: the version the first params are served as.
    scan_layers: hold the weights stacked as given (True), or layer by layer (False: the
      layout of `held_cfg`, the model with scan_layers=False, which the engine's programs run).
    fuse_projections: hold each Gated DeltaNet layer's four input projections as one matrix,
      laid out for the devices that split them (`_fuse_shards`); held apart where they do not
      split each evenly. False = as trained.
  """

  def __init__(self, cfg, params=None, *, init_seed: int = 0,
               weights_dtype: Optional[str] = None, mesh=None, rules=None,
               abstract_on: Optional[Any] = None, lora_spec: Optional[lora.LoraSpec] = None,
               initial_version: int = 0, scan_layers: bool = True,
               fuse_projections: bool = True):
    self.cfg = cfg
    self._mesh = mesh
    self._rules = rules
    self._abstract_on = abstract_on
    self._unscan = not scan_layers and cfg.scan_layers
    self.held_cfg = cfg.replace(scan_layers=False) if self._unscan else cfg
    shards = 1 if mesh is None else sharding.ways(mesh.shape, rules, "gdn_qkv")
    self._fuse_shards = (shards if fuse_projections
                         and gated_deltanet.can_fuse_in_projections(cfg, shards) else 0)
    init = lambda key: qwen3_5.init_params(cfg, key)
    given = jax.eval_shape(init, jax.random.key(0)) if params is None else params
    # What a sync brings (stacked), and what the engine holds (`_held`: stacked or per layer).
    self._abstract_params = serving_shapes(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), given), weights_dtype)
    self._abstract_held = jax.eval_shape(self._held, self._abstract_params)
    self._param_shardings = self._held_shardings = None
    if mesh is not None:
      self._param_shardings = sharding.tree_shardings(qwen3_5.param_axes(cfg),
                                                      self._abstract_params, mesh, rules)
      self._held_shardings = (
          self._param_shardings if not (self._unscan or self._fuse_shards) else
          sharding.tree_shardings(self._held_axes(), self._abstract_held, mesh, rules))
    # Placed exactly as `served` will place new weights, so a swap never recompiles.
    if abstract_on is not None:
      params = self.params_target()
    elif params is None:
      # Initialised where it is served, shard by shard: a model that needs the engine's mesh
      # does not fit one device (a served random init is a placeholder until a weight sync).
      where = ({} if self._held_shardings is None
               else {"out_shardings": self._held_shardings})
      params = jax.jit(lambda key: self._held(self._cast(init(key))),
                       **where)(jax.random.key(init_seed))
    else:
      params = self._place(self._cast(params))
    self._init_lora(lora_spec, params)
    self.handle = ParamsHandle(params, initial_version)

  def _init_lora(self, spec: Optional[lora.LoraSpec], base) -> None:
    """With LoRA: keeps `base` (the served params at start: B = 0) and the adapters' shapes and
    shardings, and jits the merge a sync runs."""
    self._lora = spec
    self.last_sync_bytes = 0   # bytes the last weight sync brought (adapters or whole params)
    if spec is None:
      return
    axes = qwen3_5.param_axes(self.cfg)
    self._base = base
    self._abstract_adapters = jax.eval_shape(
        lambda k: lora.init(spec, axes, self._abstract_params, k), jax.random.key(0))
    self._adapter_shardings = None
    if self._mesh is not None:
      self._adapter_shardings = sharding.tree_shardings(
          lora.axes(spec, axes), self._abstract_adapters, self._mesh, self._rules)
    where = {} if self._held_shardings is None else {"out_shardings": self._held_shardings}
    # Merged in the layout of the four projections apart (the adapters'), then fused again.
    self._merge_jit = jax.jit(
        lambda b, a: self._fused(lora.merge(self._unfused(b), self._layout(a), spec.scale)),
        **where)

  @property
  def version(self) -> int:
    return self.handle.version

  def served(self, params):
    """The weights to serve for what a weight sync brings: `params` checked against the
    engine's tree (structure, shapes; floats are cast to the engine's dtypes) so that nothing
    recompiles, then placed on the engine's devices (a reshard when they come from a training
    mesh). With LoRA, `params` are the adapters (`_merged`). Swapping them in is the caller's
    (`handle.swap`)."""
    want = self._abstract_params if self._lora is None else self._abstract_adapters
    if jax.tree.structure(params) != jax.tree.structure(want):
      raise ValueError("new params have a different tree structure than the engine's"
                       + (" adapters" if self._lora is not None else ""))
    bad = sharding.shape_dtype_mismatches(params, want, cast_floats=True)
    if bad:
      raise ValueError("new params differ in shape/dtype (this would recompile): " + "; ".join(bad[:5]))
    self.last_sync_bytes = lora.byte_count(params)
    if self._lora is None:
      return jax.block_until_ready(self._place(self._cast(params)))
    return self._merged(params)

  def _merged(self, adapters):
    """The served weights for `adapters`: merged into the kept base (never into the weights
    served before, so rounding does not accumulate over syncs)."""
    where = (self._adapter_shardings if self._adapter_shardings is not None
             else jax.local_devices()[0])
    adapters = jax.device_put(adapters, where, may_alias=False)
    with mesh_context(self._mesh, self._rules):
      return jax.block_until_ready(self._merge_jit(self._base, adapters))

  def sync_target(self):
    """What `served` takes, as ShapeDtypeStructs with their shardings (a restore target for a
    published version, rl/rollout/published_weights.py): `params_target`, or with LoRA the
    adapters (float32)."""
    if self._lora is None:
      return self.params_target()
    shardings = self._adapter_shardings
    if shardings is None:
      one = jax.sharding.SingleDeviceSharding(self._abstract_on or jax.local_devices()[0])
      shardings = jax.tree.map(lambda _: one, self._abstract_adapters)
    return sharding.with_shardings(self._abstract_adapters, shardings)

  def params_target(self, held: bool = False):
    """The engine's params as ShapeDtypeStructs with their shardings: a restore target that
    puts each shard of a saved tree straight on the device that serves it. `held`: in the
    layout the engine holds and its programs take (`held_cfg`'s)."""
    abstract = self._abstract_held if held else self._abstract_params
    shardings = self._held_shardings if held else self._param_shardings
    if shardings is None and self._abstract_on is not None:
      one = jax.sharding.SingleDeviceSharding(self._abstract_on)
      shardings = jax.tree.map(lambda _: one, abstract)
    return sharding.with_shardings(abstract, shardings)

  def _held(self, params):
    """Stacked `params` in the layout the engine holds."""
    return self._fused(self._layout(params))

  def _layout(self, tree):
    """Stacked `tree` (params or adapters) stacked or layer by layer, as the engine holds it."""
    return qwen3_5.unscan_layers(self.cfg, tree) if self._unscan else tree

  def _fused(self, params):
    """`params` (any layout of `blocks`) with the Gated DeltaNet input projections fused, if
    the engine fuses them."""
    if not self._fuse_shards:
      return params
    return qwen3_5.fuse_gdn_in_projections(params, self._fuse_shards)

  def _unfused(self, params):
    return qwen3_5.split_gdn_in_projections(self.cfg, params) if self._fuse_shards else params

  def _held_axes(self):
    axes = qwen3_5.param_axes(self.held_cfg)
    return qwen3_5.fused_gdn_in_projection_axes(axes) if self._fuse_shards else axes

  def _cast(self, params):
    """`params` in the engine's dtypes (a no-op for leaves already in them)."""
    return jax.tree.map(lambda x, t: x if x.dtype == t.dtype else x.astype(t.dtype),
                        params, self._abstract_params)

  def _place(self, params):
    """`params` (host or device arrays, any layout) as the engine's own copy on its devices.

    Device arrays go device to device (from a training mesh: the reshard), never through the
    host. Always a copy: a train step that donates its state (rl/train_step.py) must not be
    able to free the arrays the engine is serving with. Held per layer, each layer's slices
    are cut where the arrays are (on a device: one layer's copy at a time) and placed.
    """
    where = (self._held_shardings if self._held_shardings is not None
             else jax.local_devices()[0])
    if not self._unscan:
      return _put(self._fused(params), where)
    one = not isinstance(where, dict)   # one device: every leaf goes there
    rest = {key: v for key, v in params.items() if key != "blocks"}
    out = _put(rest, where if one else {key: where[key] for key in rest})
    layer = lambda i: self._fused({"blocks": (qwen3_5.unscanned_layer(self.cfg, params, i),)})
    out["blocks"] = tuple(
        _put(layer(i)["blocks"][0], where if one else where["blocks"][i])
        for i in range(self.cfg.num_hidden_layers))
    return out


def _put(tree, where):
  """A copy of `tree` on `where` (a sharding tree or one device), never sharing a buffer."""
  placed = jax.device_put(tree, where, may_alias=False)
  # A replicated array put on one of its own devices comes back as that device's buffer even
  # with may_alias=False (JAX 0.10): those leaves are copied on the device.
  return jax.tree.map(lambda src, out: jnp.copy(out) if _shares_buffers(src, out) else out,
                      tree, placed)
