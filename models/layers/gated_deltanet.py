"""Gated DeltaNet, the linear-attention mixer of 3 layers in 4.

Per value head h and step t, with q, k L2-normalised (q also scaled by 1/sqrt(d_k)):
    S_t = exp(g_t) * S_{t-1}                                   decay
    S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T               delta-rule write
    o_t = S_t^T q_t
S is a [d_k, d_v] float32 matrix. Training and prefill use the chunked form (the UT transform
inside each chunk of 64, inverted by matmuls; a scan across chunks); one-token decode uses the
recurrence.

Params (shapes with logical names):
  in_proj_qkv [embed, gdn_qkv]      q (nk*dk) | k (nk*dk) | v (nv*dv), the conv channels
  in_proj_z   [embed, gdn_value]    output gate
  in_proj_b   [embed, gdn_heads]    beta = sigmoid(b)
  in_proj_a   [embed, gdn_heads]    decay input
  (serving: the four as one in_proj [embed, gdn_qkv (shards), n], `fuse_in_projections`)
  conv        [conv_kernel, gdn_qkv] causal depthwise conv taps (last tap = current token)
  dt_bias, A_log [gdn_heads]        g = -exp(A_log) * softplus(a + dt_bias)
  norm        [head_v_dim]          gated RMSNorm weight (init 1)
  out_proj    [gdn_value, embed]
"""
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models import config as config_lib
from models.config import ModelConfig
from models.layers import common
from models.layers import gdn_fused
from models.layers import norm


def init(key, cfg: ModelConfig) -> dict:
  h, nv = cfg.hidden_size, cfg.linear_num_value_heads
  keys = jax.random.split(key, 7)
  std, dt = cfg.initializer_range, cfg.jnp_param_dtype
  return {
      "in_proj_qkv": common.normal(keys[0], (h, cfg.gdn_conv_dim), std, dt),
      "in_proj_z": common.normal(keys[1], (h, cfg.gdn_value_dim), std, dt),
      "in_proj_b": common.normal(keys[2], (h, nv), std, dt),
      "in_proj_a": common.normal(keys[3], (h, nv), std, dt),
      "conv": common.normal(keys[4], (cfg.linear_conv_kernel_dim, cfg.gdn_conv_dim),
                            cfg.linear_conv_kernel_dim ** -0.5, dt),
      "dt_bias": jnp.ones((nv,), dt),
      "A_log": jnp.log(jax.random.uniform(keys[5], (nv,), jnp.float32, 1.0, 16.0)).astype(dt),
      "norm": jnp.ones((cfg.linear_value_head_dim,), dt),
      "out_proj": common.normal(keys[6], (cfg.gdn_value_dim, h), std, dt),
  }


def axes(cfg: ModelConfig) -> dict:
  del cfg
  return {
      "in_proj_qkv": ("embed", "gdn_qkv"),
      "in_proj_z": ("embed", "gdn_value"),
      "in_proj_b": ("embed", "gdn_heads"),
      "in_proj_a": ("embed", "gdn_heads"),
      "conv": ("conv_kernel", "gdn_qkv"),
      "dt_bias": ("gdn_heads",),
      "A_log": ("gdn_heads",),
      "norm": ("norm",),
      "out_proj": ("gdn_value", "embed"),
  }


# -- the serving layout: the four input projections as one matrix ---------------------------
# The rollout engine holds them so (rl/rollout/engine_weights.py): a decode step's four matmuls
# of one input are then one matmul reading one matrix. Held apart, XLA:GPU's dot merger joined
# them anyway by concatenating the four matrices into a new one every step (written and read
# again: 6 MiB a layer in the ~1B benchmark model, 48 MiB a GPU a layer in 35B-A3B's engine;
# compiler figures, docs/results.md). Training keeps the four (their layout is the checkpoint's
# and Hugging Face's).
IN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def in_projection_sizes(cfg: ModelConfig) -> tuple[int, ...]:
  """The output widths of `IN_PROJECTIONS`, in order."""
  nv = cfg.linear_num_value_heads
  return (cfg.gdn_conv_dim, cfg.gdn_value_dim, nv, nv)


def can_fuse_in_projections(cfg: ModelConfig, shards: int) -> bool:
  """Whether `shards` devices split each of the four projections' outputs evenly (then each
  holds its own columns of each in the fused matrix, as it held them apart)."""
  return shards >= 1 and all(n % shards == 0 for n in in_projection_sizes(cfg))


def fuse_in_projections(p: dict, shards: int) -> dict:
  """A layer's params (leaves with any leading layer axes) with `IN_PROJECTIONS` replaced by
  one `in_proj` [..., embed, shards, n]: row s holds shard s's columns of qkv | z | b | a, so a
  split of the shards axis over `shards` devices gives each the columns it held of each
  matrix apart, and the matmul's output [b, t, shards, n] is split back without moving data
  between devices. Host (numpy) arrays stay on the host. Exact: `split_in_projections` undoes it.
  """
  ws = [p[k] for k in IN_PROJECTIONS]
  xp = np if all(isinstance(w, np.ndarray) for w in ws) else jnp
  parts = [w.reshape(*w.shape[:-1], shards, w.shape[-1] // shards) for w in ws]
  out = {k: v for k, v in p.items() if k not in IN_PROJECTIONS}
  out["in_proj"] = xp.concatenate(parts, axis=-1)
  return out


def split_in_projections(p: dict, cfg: ModelConfig) -> dict:
  """`fuse_in_projections` undone: the four matrices back from `in_proj`."""
  w = p["in_proj"]
  out = {k: v for k, v in p.items() if k != "in_proj"}
  out.update(zip(IN_PROJECTIONS, _split_fused(w, cfg, w.shape[:-2])))
  return out


def fused_in_projection_axes(axes: dict) -> dict:
  """A layer's logical axes (`axes`, with any leading axes) for `fuse_in_projections`' layout."""
  lead = axes["in_proj_qkv"][:-2]
  out = {k: v for k, v in axes.items() if k not in IN_PROJECTIONS}
  out["in_proj"] = lead + ("embed", "gdn_qkv", None)
  return out


def _split_fused(y, cfg: ModelConfig, lead: tuple):
  """[*lead, shards, n] (the fused matrix, or its matmul's output) -> the four projections'
  [*lead, width] in `IN_PROJECTIONS` order."""
  shards = y.shape[-2]
  cuts = np.cumsum([n // shards for n in in_projection_sizes(cfg)])[:-1]
  xp = np if isinstance(y, np.ndarray) else jnp
  return [x.reshape(*lead, x.shape[-2] * x.shape[-1]) for x in xp.split(y, cuts, axis=-1)]


def _l2norm(x, eps=1e-6):
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# The state is float32 by contract; on TPU a plain float32 matmul would run one bf16 pass, on
# a GPU TF32. The chunked delta rule's matmuls take `model.gdn_precision` (default HIGHEST);
# the recurrent (decode) form always runs HIGHEST.
_HIGHEST = jax.lax.Precision.HIGHEST


def _mm(a, b, precision=_HIGHEST):
  return jnp.matmul(a, b, precision=precision)


# Diagonal blocks of at most this size are inverted by the matmul product; larger ones by halves.
_INVERSE_BASE = 16


def _unit_lower_inverse(strict_lower, precision=_HIGHEST):
  """(I + L)^-1 for strictly lower-triangular L [..., c, c], by matmuls only.

  By halves: [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]], the two diagonal halves
  inverted together as one batch, down to blocks of `_INVERSE_BASE`, which are inverted as
  the nilpotent series (I + L)^-1 = (I - L)(I + L^2)(I + L^4)... (log2 of the block size
  factors). Matmuls suit every backend (no LAPACK custom call on CPU, MXU-friendly on TPU).
  On CPU, for 256 systems of 64 x 64 (4 x 1024 tokens, 4 heads): 5.8 ms by halves against
  50 ms for the series over the whole 64 x 64 (which costs 10 full-size matmuls), with the
  same error against float64 (2e-7); `jax.scipy.linalg.solve_triangular` took ~10x the
  series' time. The gradient is `_unit_lower_solve`'s hand-written one.
  """
  c = strict_lower.shape[-1]
  if c > _INVERSE_BASE and c % 2 == 0:
    h = c // 2
    halves = _unit_lower_inverse(jnp.stack([strict_lower[..., :h, :h],
                                            strict_lower[..., h:, h:]], axis=-3), precision)
    top_inv, bottom_inv = halves[..., 0, :, :], halves[..., 1, :, :]
    corner = -_mm(bottom_inv, _mm(strict_lower[..., h:, :h], top_inv, precision), precision)
    zeros = jnp.zeros_like(top_inv)
    return jnp.concatenate([jnp.concatenate([top_inv, zeros], -1),
                            jnp.concatenate([corner, bottom_inv], -1)], -2)
  eye = jnp.eye(c, dtype=strict_lower.dtype)
  power = -strict_lower
  inverse = eye + power
  for _ in range(max(int(math.ceil(math.log2(c))) - 1, 0)):
    power = _mm(power, power, precision)
    inverse = inverse + _mm(inverse, power, precision)
  return inverse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unit_lower_solve(precision, strict_lower, rhs):
  """X = (I + L)^-1 rhs for strictly lower-triangular L [..., c, c] and each of the right-hand
  sides `rhs` (a tuple of [..., c, d_i]); returns the tuple of X's.

  The gradient is written by hand: autodiff through `_unit_lower_inverse` saves every
  power and partial product of its log-depth loop and runs ~2 log2(c) c x c x c matmuls
  backwards. From (I + L) X = rhs: rhs_bar = Y^T X_bar and L_bar = -sum_i rhs_bar_i X_i^T
  (strictly lower part), with Y = (I + L)^-1: two c x c x d matmuls a side, Y and the X's the
  only residuals. The sides stay apart: concatenated into one [..., c, sum d_i] operand, XLA
  wrote the concatenation and each side's slice of the result and of its gradient as copies
  of float32 per-token tensors (the ~1B GRPO step compiled for an H200: Gated DeltaNet traffic
  470 -> 449 GiB a step; compiler figures, docs/results.md#one-h200).
  """
  inverse = _unit_lower_inverse(strict_lower, precision)
  return tuple(_mm(inverse, r, precision) for r in rhs)


def _unit_lower_solve_fwd(precision, strict_lower, rhs):
  inverse = _unit_lower_inverse(strict_lower, precision)
  xs = tuple(_mm(inverse, r, precision) for r in rhs)
  return xs, (inverse, xs)


def _unit_lower_solve_bwd(precision, residuals, xs_bar):
  inverse, xs = residuals
  rhs_bar = tuple(_mm(jnp.swapaxes(inverse, -1, -2), x_bar, precision) for x_bar in xs_bar)
  c = inverse.shape[-1]
  strictly_lower = jnp.tril(jnp.ones((c, c), dtype=bool), -1)
  outer = sum(jnp.einsum("...id,...jd->...ij", r, x, precision=precision)
              for r, x in zip(rhs_bar, xs))
  return jnp.where(strictly_lower, -outer, 0.0), rhs_bar


_unit_lower_solve.defvjp(_unit_lower_solve_fwd, _unit_lower_solve_bwd)

GDN_BACKWARDS = ("custom", "autodiff")

# `gdn_chunk_size=-1` (auto) per backend. cpu: 32, measured on the whole model step
# (docs/results.md, "Model step and decode"): the intra-chunk work grows with the chunk.
# Elsewhere 64, the chunk of the reference kernels (flash-linear-attention); on an H200, 128
# ran the ~1B model's step no faster (docs/results.md#one-h200).
AUTO_CHUNK = {"cpu": 32}


def chunk_size(cfg: ModelConfig, backend: str | None = None) -> int:
  """The chunk length of the chunked delta rule for `cfg.gdn_chunk_size` (-1 = auto)."""
  if cfg.gdn_chunk_size == -1:
    return AUTO_CHUNK.get(backend or config_lib.platform(), 64)
  return cfg.gdn_chunk_size


def chunked_delta_rule(q, k, v, g, beta, state, chunk_size: int, backward: str = "custom",
                       precision: str = "highest", scan: str = "outputs",
                       storage: str = "float32"):
  """The gated delta rule over a sequence, chunk by chunk.

  Args:
    q, k: [batch, seq, heads, d_k] float32, already normalised and scaled.
    v: [batch, seq, heads, d_v] float32.
    g: [batch, seq, heads] log decay (<= 0); beta: [batch, seq, heads] write strength.
    state: [batch, heads, d_k, d_v] float32 initial state.
    backward: how the intra-chunk triangular solve is differentiated: "custom" (its
      hand-written VJP, `_unit_lower_solve`) or "autodiff" (through the matmul loop; the
      reference). The forward values are the same. Unused by "fused" (its kernel's own).
    precision: of the matmuls (`model.gdn_precision`: highest | high | default); the state,
      decays and sums stay float32 whatever it is.
    scan: what the scan over chunks computes (`model.gdn_scan`): "outputs", each chunk's
      output with its state's update (four matmuls a step); "states", only the state's
      recurrence (two), every chunk's output, q S + intra v_new, after it at once from the
      states it returns. The same values; "states" returns every chunk's state where the
      other keeps them for its gradient only. "fused": "states" with each chunk's
      triangular solve, the recurrence and the outputs one GPU kernel a pass each, forward
      and backward (`gdn_fused`; Pallas' interpreter on CPU).
    storage: "fused" only (`model.gdn_storage_dtype`): the dtype q, k, v and the kernels'
      results (u, w, the states, the corrected values, the outputs; their gradients alike)
      are stored in between the kernels, which compute in float32 whatever it is. The
      decays, write strengths and the final state stay float32.
  Returns:
    (out [batch, seq, heads, d_v], final state).
  """
  b, t, nh, dk = k.shape
  dv = v.shape[-1]
  c = chunk_size
  prec = jax.lax.Precision(precision)
  pad = (-t) % c
  if pad:  # zero keys, values, beta and log-decay leave the state untouched
    padder = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = map(padder, (q, k, v, g, beta))
  n = (t + pad) // c
  if scan == "fused":     # stored as the kernels keep them (before the moves below)
    q, k, v = (x.astype(storage) for x in (q, k, v))
  # -> [n_chunks, batch, heads, chunk, dim] so the scan runs over chunks.
  to_chunks = lambda x: jnp.moveaxis(x.reshape(b, n, c, nh, -1), (1, 3), (0, 2))
  q, k, v = to_chunks(q), to_chunks(k), to_chunks(v)
  g, beta = to_chunks(g[..., None])[..., 0], to_chunks(beta[..., None])[..., 0]

  g_cum = jnp.cumsum(g, axis=-1)                                   # [n, b, h, c]
  to_end = jnp.flip(jnp.cumsum(jnp.flip(g, -1), axis=-1), -1) - g   # sum of g over (i, end]
  k_to_end = k * jnp.exp(to_end)[..., None]
  chunk_decay = jnp.exp(g_cum[..., -1])[..., None, None]
  if scan == "fused":  # kernels that build k k^T, q k^T and the decays in registers
    u, w = gdn_fused.ut_transform(k, v, g, beta, prec)
    states, v_new, state = gdn_fused.walk(u, w, k_to_end.astype(storage),
                                          chunk_decay[..., 0, 0], state, prec)
    out = gdn_fused.chunk_outputs(q, k, g, states, v_new, prec)
  else:
    u, w, decay = _ut_transform(k, v, g, g_cum, beta, backward, prec)
    intra = jnp.einsum("...id,...jd->...ij", q, k, precision=prec) * decay  # causal in chunk
    q_decayed = q * jnp.exp(g_cum)[..., None]
    out, state = _scan_chunks(scan, prec, state, u, w, intra, q_decayed, k_to_end, chunk_decay)
  out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(b, n * c, nh, dv)[:, :t]
  return out, state


def _ut_transform(k, v, g, g_cum, beta, backward: str, prec):
  """Each chunk's u = (I + L)^-1 (beta v) and w = (I + L)^-1 (beta k e^{g_cum}), L the strictly
  lower (k beta k^T) * D, and D [.., c, c] (each input [n_chunks, batch, heads, chunk, ...]).

  D[i, j] = prod of exp(g) over (j, i]. Its log is summed over the segment itself rather than
  taken as g_cum[i] - g_cum[j]: with strong decay the cumulative sums reach hundreds, and
  their difference would lose the low bits that the A_log / dt_bias gradients need.
  """
  c = g.shape[-1]
  lower = jnp.tril(jnp.ones((c, c), dtype=bool))
  strictly_lower = jnp.tril(jnp.ones((c, c), dtype=bool), -1)
  segment = jnp.cumsum(jnp.where(strictly_lower, g[..., :, None], 0.0), axis=-2)
  decay = jnp.exp(jnp.where(lower, segment, -jnp.inf))
  k_beta = k * beta[..., None]
  system = jnp.where(strictly_lower, jnp.einsum("...id,...jd->...ij", k_beta, k, precision=prec)
                     * decay, 0.0)
  if backward == "custom":  # one inverse for both right-hand sides
    u, w = _unit_lower_solve(prec, system, (v * beta[..., None],
                                            k_beta * jnp.exp(g_cum)[..., None]))
  elif backward == "autodiff":
    inverse = _unit_lower_inverse(system, prec)
    u = _mm(inverse, v * beta[..., None], prec)
    w = _mm(inverse, k_beta * jnp.exp(g_cum)[..., None], prec)
  else:
    raise ValueError(f"model.gdn_backward must be one of {GDN_BACKWARDS}, got {backward!r}")
  return u, w, decay


def _scan_chunks(scan: str, prec, state, u, w, intra, q_decayed, k_to_end, chunk_decay):
  """The chunked rule's walk over the chunks (each input [n_chunks, batch, heads, ...]):
  returns (out [n_chunks, batch, heads, chunk, d_v], final state). `scan` is
  `chunked_delta_rule`'s: "outputs" computes each chunk's output in the scan, "states" only
  the state's recurrence, the outputs after it from the states the scan returns ("fused",
  `gdn_fused`'s kernels, is `chunked_delta_rule`'s own branch)."""
  mm = functools.partial(_mm, precision=prec)

  def corrected(s, u_i, w_i):        # the chunk's values less what its state predicts
    return u_i - mm(w_i, s)

  def update(s, k_i, decay_i, v_new):
    return s * decay_i + mm(jnp.swapaxes(k_i, -1, -2), v_new)

  if scan == "outputs":
    def step(s, xs):
      u_i, w_i, intra_i, q_i, k_i, decay_i = xs
      v_new = corrected(s, u_i, w_i)
      return update(s, k_i, decay_i, v_new), mm(q_i, s) + mm(intra_i, v_new)

    state, out = jax.lax.scan(step, state, (u, w, intra, q_decayed, k_to_end, chunk_decay))
    return out, state
  if scan == "states":
    def step(s, xs):
      u_i, w_i, k_i, decay_i = xs
      v_new = corrected(s, u_i, w_i)
      return update(s, k_i, decay_i, v_new), (s, v_new)

    state, (states, v_new) = jax.lax.scan(step, state, (u, w, k_to_end, chunk_decay))
  else:
    raise ValueError(f"model.gdn_scan must be one of {config_lib.GDN_SCANS}, got {scan!r}")
  return mm(q_decayed, states) + mm(intra, v_new), state


def recurrent_delta_rule(q, k, v, g, beta, state):
  """The same rule one step at a time (decode; also the reference for the chunked form).

  `state` and the returned state are S transposed, [b, h, d_v, d_k]: the cache's layout
  (`forward`). Each step's two reads of S contract over d_k, and XLA:GPU lays S out with d_k
  minor for them; a cache stored [.., d_k, d_v] was transposed whole into that layout and back
  around every decode step's layer loop (three times the state's own traffic).
  """
  def step(s, xs):
    q_t, k_t, v_t, g_t, beta_t = xs                                # [b, h, d]..., [b, h]
    s = s * jnp.exp(g_t)[..., None, None]
    predicted = jnp.einsum("bhvk,bhk->bhv", s, k_t, precision=_HIGHEST)
    s = s + jnp.einsum("bhv,bhk->bhvk", (v_t - predicted) * beta_t[..., None], k_t, precision=_HIGHEST)
    return s, jnp.einsum("bhvk,bhk->bhv", s, q_t, precision=_HIGHEST)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
  state, out = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(out, 0, 1), state


def _causal_conv(x, conv_state, weight):
  """Depthwise causal conv with SiLU.

  x [b, t, *ch]; conv_state [b, kernel-1, *ch], the inputs just before x (zeros at the start);
  weight [kernel, *ch]. Returns the activations [b, t, *ch] and the padded input [b,
  kernel-1+t, *ch].
  """
  kernel = weight.shape[0]
  xp = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)
  t = x.shape[1]
  out = sum(xp[:, j:j + t] * weight[j].astype(x.dtype) for j in range(kernel))
  return jax.nn.silu(out), xp


def _split_channels(a, shapes):
  """a [..., conv_dim] (the conv's weight or state) -> its q, k and v channels, [..., heads,
  head_dim] each with `shapes` ((heads, head_dim) of q, k and v)."""
  cuts = list(itertools.accumulate(n * d for n, d in shapes))[:-1]
  return [c.reshape(*c.shape[:-1], n, d) for c, (n, d) in zip(jnp.split(a, cuts, axis=-1),
                                                              shapes)]


def _causal_conv_heads(parts, conv_states, weights):
  """`_causal_conv` of each of q, k, v [b, t, heads, head_dim] with its channels' state and
  weight: ([activations], [padded inputs])."""
  outs = [_causal_conv(x, c, w) for x, c, w in zip(parts, conv_states, weights)]
  return [o for o, _ in outs], [pad for _, pad in outs]


def forward(p, x, cfg: ModelConfig, state=None, lengths=None, rule: str = "chunked",
            recompute: bool | None = None, layer=None):
  """Gated DeltaNet over x [batch, seq, embed].

  Args:
    state: optional {"conv": [b, kernel-1, conv_dim], "ssm": [b, v_heads, d_v, d_k] f32, the
      delta rule's state S transposed (`recurrent_delta_rule` says why)} to continue from
      (decode) or None to start from zeros.
    lengths: optional [batch] valid lengths of a right-padded batch. Padded steps neither
      decay nor write the state, so the returned state is each row's state at its length.
    rule: "chunked" (training, prefill) or "recurrent" (decode).
    recompute: the gradient keeps only the mixer's bfloat16 inputs (the four projections'
      outputs) and its output, and recomputes the rest in the backward pass (`_mix`). False
      keeps what autodiff saves; the values and gradients are the same. None (the default):
      `cfg.gdn_recompute`.
    layer: None, or (decode with `cfg.gdn_decode == "fused"`) the index of this layer in
      `state`, which is then every layer's stacked {"conv": [L, ...], "ssm": [L, ...]}: the
      kernel updates the layer's S in place in the stack (`gdn_fused.recurrent_step`), where
      XLA's step reads S several times and copies the new one into the stack.
  Returns:
    ([batch, seq, embed], new state; stacked if it came stacked).
  """
  dt = cfg.jnp_dtype
  x = x.astype(dt)
  # The projections in and out run where the row's positions are (split by position under
  # context parallelism) and only their outputs change layout (all-to-alls, split by head in
  # `_mix`): left to itself, XLA gathered each layer's input x whole instead, and in the backward
  # pass the head-split cotangents (35B-A3B's step on 16 H200: ~19k GiB of all-gathers a GPU,
  # compiler figures).
  rows = ("batch", "activation_length", None)
  if "in_proj" in p:   # the serving layout: one matmul (`fuse_in_projections`)
    projected = _split_fused(common.dense(x, p["in_proj"], dt), cfg, x.shape[:-1])
  else:
    projected = [common.dense(x, p[k], dt) for k in IN_PROJECTIONS]
  qkv, z, beta_in, a = (common.constrain(y, rows) for y in projected)
  mix_params = {k: p[k] for k in ("conv", "A_log", "dt_bias", "norm")}
  mix = functools.partial(_mix, cfg=cfg, rule=rule)
  if cfg.gdn_recompute if recompute is None else recompute:
    mix = common.recompute(mix)
  mix_state = state if layer is None else {"conv": state["conv"][layer], "ssm": state["ssm"]}
  out, conv_state, ssm = mix(mix_params, qkv, z, beta_in, a, mix_state, lengths, layer)
  out = common.dense(common.constrain(out, rows), p["out_proj"], dt)
  conv_dtype = dt if state is None else state["conv"].dtype
  conv_state = conv_state.astype(conv_dtype)
  if layer is not None:
    conv_state = state["conv"].at[layer].set(conv_state)
  return out, {"conv": conv_state, "ssm": ssm}


def _conv_by_head(qkv, conv_state, conv_w, lengths, cfg: ModelConfig):
  """The causal conv of q, k and v (qkv [b, t, conv_dim]), each as [b, t, heads, head_dim]
  laid out as whole rows split by head. Returns ([q, k, v], the conv state [b, kernel-1,
  conv_dim] at each row's length, how many times each q/k head was repeated here).

  Whole rows, split by head (models/sharding.context_parallel_rules): the chunk scan after it
  walks the row, which must not be split by position. q, k and v move there each on its own,
  in the activation dtype, before the conv (depthwise: a head's channels are its own) and
  before anything float32: moved after the conv, XLA sent float32 intermediates of the delta
  rule and blocks of the conv's channels that match no head between devices. Each q/k head
  serves nv/nk consecutive value heads: repeated after the move where the devices split the
  key heads evenly (each repeats its own), here, before it, where they do not (397B-A17B's 16
  over 64 devices: the uneven split cost ~14k GiB of float32 permutes a GPU a step, compiler
  figures). The conv acts head by head: where the repeat happens changes no value."""
  b, t, _ = qkv.shape
  nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  kernel = cfg.linear_conv_kernel_dim
  shapes = ((nk, cfg.linear_key_head_dim), (nk, cfg.linear_key_head_dim),
            (nv, cfg.linear_value_head_dim))

  def ends(padded_in):  # the kernel-1 inputs ending at each row's last valid token
    if lengths is None:
      return padded_in[:, t:]
    idx = lengths[:, None] + jnp.arange(kernel - 1)[None, :]
    return jnp.take_along_axis(padded_in, idx.reshape(*idx.shape, *(1,) * (padded_in.ndim - 2)),
                               axis=1)

  if common.split_ways("activation_heads") == 1 and common.split_ways("activation_length") == 1:
    # Nothing to move: one conv over all the channels (three took 253 more kernels in the ~1B
    # model's step on an H200 and 2 GiB more temporaries on XLA:CPU).
    out, padded_in = common.recompute(_causal_conv)(qkv, conv_state, conv_w)
    return _split_channels(out, shapes), ends(padded_in), 1
  heads = ("batch", None, "activation_heads", None)
  rows = ("batch", "activation_length", None, None)
  repeat = nv // nk if nk % common.split_ways("activation_heads") else 1
  widen = lambda x: jnp.repeat(x, repeat, axis=-2) if repeat > 1 else x
  q, k, v = _split_channels(qkv, shapes)
  parts = [common.constrain(common.constrain(x, rows), heads) for x in (widen(q), widen(k), v)]
  conv_in = [[widen(x[0]), widen(x[1]), x[2]] for x in (_split_channels(conv_state, shapes),
                                                        _split_channels(conv_w, shapes))]
  # Recomputed where its gradient is taken (after the delta rule's backward): its own
  # intermediates (the shifted taps) never coexist with the delta rule's (the ~1B layer's
  # backward on XLA:CPU: 175 -> 154 KiB a token at its peak, with the output norm's; XLA:GPU's
  # fusions kept none of them there already).
  out, padded_in = common.recompute(_causal_conv_heads)(parts, *conv_in)
  # The conv's state keeps each q/k channel once.
  padded_in = [x[:, :, ::repeat] for x in padded_in[:2]] + padded_in[2:]
  state = [ends(x).reshape(b, kernel - 1, -1) for x in padded_in]
  return out, jnp.concatenate(state, axis=-1), repeat


def _mix(p, qkv, z, beta_in, a, state, lengths, layer, cfg: ModelConfig, rule: str):
  """Everything between the input projections and out_proj, one function so that `forward`
  can rematerialise it whole.

  Autodiff through it would keep ~20 float32 tensors of [tokens, v_heads, head_dim] a layer
  for the backward pass (q, k, v in float32, repeated to the value heads, in the chunk layout
  and decayed, the UT transform's right-hand sides and solutions, every chunk's state: ~150
  KiB a token on the ~1B benchmark model against the 4 KiB of its bfloat16 inputs); under
  `jax.checkpoint` the backward pass recomputes them from the inputs, one layer at a time.

  Args:
    qkv: [b, t, conv_dim] the conv's input; z: [b, t, v_heads * d_v]; beta_in, a: [b, t,
      v_heads], all in the activation dtype.
    state: as in `forward`; None starts from zeros (made here, so the gradient does not keep
      a [b, v_heads, d_v, d_k] array of zeros). With `layer` (`forward`'s), its "ssm" is every
      layer's stacked S and the returned ssm state the stack, this layer's updated.
  Returns:
    (gated, normed output [b, t, v_heads * d_v], conv state [b, kernel-1, conv_dim], ssm state).
  """
  b, t, _ = qkv.shape
  dt = cfg.jnp_dtype
  nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  kernel = cfg.linear_conv_kernel_dim
  if state is None:
    state = {"conv": jnp.zeros((b, kernel - 1, cfg.gdn_conv_dim), dt),
             "ssm": jnp.zeros((b, nv, dv, dk), jnp.float32)}
  z = z.reshape(b, t, nv, dv)
  heads = ("batch", None, "activation_heads")
  (q, k, v), conv_state, repeat = _conv_by_head(qkv, state["conv"], p["conv"], lengths, cfg)
  if rule == "recurrent" and cfg.gdn_decode == "fused" and t == 1:
    # One kernel from the conv's outputs to the gated norm (`gdn_fused.recurrent_step`): XLA
    # ran the norms, the gates and the output norm as ~5 kernels a layer beside the update.
    live = jnp.ones((b,), jnp.float32) if lengths is None else (lengths > 0).astype(jnp.float32)
    gates = jnp.concatenate([z[:, 0], beta_in[:, 0, :, None], a[:, 0, :, None]], axis=-1)
    out, ssm = gdn_fused.recurrent_step(q[:, 0], k[:, 0], v[:, 0], gates, live, p,
                                        state["ssm"], layer, cfg.rms_norm_eps)
    out = common.constrain(out[:, None], heads + (None,))
    return out.reshape(b, t, nv * dv), conv_state, ssm
  beta = jax.nn.sigmoid(beta_in.astype(jnp.float32))
  a = a.astype(jnp.float32)
  g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a + p["dt_bias"].astype(jnp.float32))

  if lengths is not None:
    valid = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)[..., None]
    g, beta = g * valid, beta * valid

  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  # Each q/k head serves nv/nk consecutive value heads (repeated here unless it was already).
  q = jnp.repeat(_l2norm(q), nv // nk // repeat, axis=2) * (dk ** -0.5)
  k = jnp.repeat(_l2norm(k), nv // nk // repeat, axis=2)
  q, k, v = (common.constrain(x, heads + (None,)) for x in (q, k, v))
  g, beta = common.constrain(g, heads), common.constrain(beta, heads)
  z = common.constrain(z, heads + (None,))
  if rule == "chunked":
    out, ssm = chunked_delta_rule(q, k, v, g, beta, jnp.swapaxes(state["ssm"], -1, -2),
                                  chunk_size(cfg), cfg.gdn_backward, cfg.gdn_precision,
                                  cfg.gdn_scan, cfg.gdn_storage_dtype)
    ssm = jnp.swapaxes(ssm, -1, -2)
  elif rule == "recurrent":
    if layer is not None:
      raise ValueError("a stacked Gated DeltaNet state with a layer index is for one-token "
                       "decode steps with model.gdn_decode=fused")
    out, ssm = recurrent_delta_rule(q, k, v, g, beta, state["ssm"])
  else:
    raise ValueError(f"unknown delta rule form {rule!r}")
  # Recomputed where its gradient is taken, as the conv is (`_conv_by_head`): its float32
  # terms never coexist with the delta rule's intermediates.
  out = common.recompute(functools.partial(norm.gated_rms_norm, eps=cfg.rms_norm_eps))(
      out.astype(dt), z, p["norm"])
  # Normed here, split by head, and only then back to a row split by position (`forward`):
  # otherwise XLA moved the delta rule's float32 output across devices and normed it there.
  out = common.constrain(out, heads + (None,))
  return out.reshape(b, t, nv * dv), conv_state, ssm
