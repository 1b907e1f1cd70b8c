"""The MoE dispatches: compiled cost against the expert count, and parity with ragged_dot."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
import math
import re

import numpy as np
import pytest

from configs import base
from models import aot
from models import config as config_lib
from models import qwen3_5
from models.layers import common
from models.layers import moe
from models.layers import moe_fused


def _cfg(num_experts, k=2, dispatch="auto", block=128, hidden=64, mlp=64, shared=32):
  m = base.get_model_config()
  m.update(hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=k,
           moe_intermediate_size=mlp, shared_expert_intermediate_size=shared,
           moe_dispatch=dispatch, moe_block_size=block)
  return qwen3_5.config_from_dict(m)


def _flops(fn, *args):
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"])


def _block_flops(num_experts, dispatch):
  """(forward, forward+backward) FLOPs of the compiled MoE block: 512 tokens, top-2, width 64."""
  cfg = _cfg(num_experts, dispatch=dispatch, shared=0)
  p = moe.init(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (2, 256, cfg.hidden_size))
  fwd = lambda p, x: moe.forward(p, x, cfg)[0]
  grad = jax.grad(lambda p, x: jnp.sum(fwd(p, x) ** 2), argnums=(0, 1))
  return _flops(fwd, p, x), _flops(grad, p, x)


def test_default_dispatch_flops_do_not_grow_with_expert_count():
  fwd8, bwd8 = _block_flops(8, "auto")
  fwd64, bwd64 = _block_flops(64, "auto")
  assert fwd64 / fwd8 < 1.5, (fwd8, fwd64)
  assert bwd64 / bwd8 < 1.5, (bwd8, bwd64)
  if jax.default_backend() == "cpu":
    # The measure can fail: XLA:CPU expands ragged_dot to every row against every expert.
    rfwd8, rbwd8 = _block_flops(8, "ragged_dot")
    rfwd64, rbwd64 = _block_flops(64, "ragged_dot")
    assert rfwd64 / rfwd8 > 5 and rbwd64 / rbwd8 > 5, (rfwd8, rfwd64, rbwd8, rbwd64)
    assert fwd64 < rfwd64 / 5 and bwd64 < rbwd64 / 5


def _routing(case, n, num_experts, rng):
  """(k, expert ids [n, k]) for a routing case."""
  if case == "one_expert":
    return 1, np.full((n, 1), 3)
  if case == "one_expert_top2":       # every token's two slots on the same two experts
    return 2, np.tile(np.array([[5, 2]]), (n, 1))
  if case == "empty_experts":         # experts 0 and 7 get no token
    return 2, np.stack([rng.choice(np.arange(1, num_experts - 1), 2, replace=False)
                        for _ in range(n)])
  return 3, np.stack([rng.choice(num_experts, 3, replace=False) for _ in range(n)])


def _routed_problem(case, seed):
  """75 tokens routed over 8 experts as `case` says: (experts, router weights, ragged_dot's
  config, params, x, a cotangent, loss(cfg) -> f(p, x, w))."""
  n, num_experts = 75, 8                      # 75 tokens: no multiple of any block size > 1
  rng = np.random.default_rng(seed)
  k, experts = _routing(case, n, num_experts, rng)
  experts = jnp.asarray(experts, jnp.int32)
  weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(n, k)), jnp.float32), axis=-1)
  ref_cfg = _cfg(num_experts, k=k, dispatch="ragged_dot")
  p = moe.init(jax.random.key(0), ref_cfg)
  x = jax.random.normal(jax.random.key(1), (n, ref_cfg.hidden_size))
  cot = jax.random.normal(jax.random.key(2), (n, ref_cfg.hidden_size))
  loss = lambda c: lambda p, x, w: jnp.sum(moe.routed_experts(p, x, w, experts, c) * cot)
  return experts, weights, ref_cfg, p, x, loss


@pytest.mark.parametrize("case", ["spread", "one_expert", "one_expert_top2", "empty_experts"])
def test_blocked_dispatch_matches_ragged_dot_outputs_and_gradients(case):
  experts, weights, ref_cfg, p, x, loss = _routed_problem(case, 0)
  out_ref = jax.jit(lambda p, x, w: moe.routed_experts(p, x, w, experts, ref_cfg))(p, x, weights)
  g_ref = jax.jit(jax.grad(loss(ref_cfg), argnums=(0, 1, 2)))(p, x, weights)
  scale = float(jnp.max(jnp.abs(out_ref)))
  assert scale > 0
  # block 1: a block per row; 8: groups span several blocks, the last one part padding;
  # 128: the largest block the token count allows (16 rows here, or 8 with top-1). Chunks:
  # the matmuls in a loop of that many blocks a step (0: all at once), the last step padded.
  for block, chunk in ((1, 0), (8, 0), (128, 0), (1, 7), (8, 3)):
    cfg = ref_cfg.replace(moe_dispatch="blocked", moe_block_size=block, moe_block_chunk=chunk)
    out = jax.jit(lambda p, x, w: moe.routed_experts(p, x, w, experts, cfg))(p, x, weights)
    np.testing.assert_allclose(out, out_ref, atol=1e-5 * scale, rtol=0, err_msg=f"block {block} chunk {chunk}")
    g = jax.jit(jax.grad(loss(cfg), argnums=(0, 1, 2)))(p, x, weights)
    for name, a, b in zip(["params", "x", "router weights"], g, g_ref):
      for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        tol = 1e-5 * float(jnp.max(jnp.abs(v))) + 1e-12
        np.testing.assert_allclose(u, v, atol=tol, rtol=0, err_msg=f"block {block} chunk {chunk}: {name} {path}")


def test_default_dispatch_moe_block_with_router_matches_ragged_dot():
  cfg = _cfg(8, k=2, dispatch="auto", block=16)
  ref_cfg = cfg.replace(moe_dispatch="ragged_dot")
  p = moe.init(jax.random.key(3), cfg)
  x = jax.random.normal(jax.random.key(4), (3, 37, cfg.hidden_size))

  def loss(c):
    def f(p, x):
      out, logits = moe.forward(p, x, c)
      return jnp.sum(out ** 2) + 1e-3 * jnp.sum(logits ** 2)
    return f
  out, logits = jax.jit(lambda p, x: moe.forward(p, x, cfg))(p, x)
  out_ref, logits_ref = jax.jit(lambda p, x: moe.forward(p, x, ref_cfg))(p, x)
  np.testing.assert_allclose(out, out_ref, atol=1e-5 * float(jnp.max(jnp.abs(out_ref))), rtol=0)
  np.testing.assert_array_equal(logits, logits_ref)
  g = jax.jit(jax.grad(loss(cfg), argnums=(0, 1)))(p, x)
  g_ref = jax.jit(jax.grad(loss(ref_cfg), argnums=(0, 1)))(p, x)
  for u, v in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(u, v, atol=1e-5 * float(jnp.max(jnp.abs(v))), rtol=0)


def test_blocked_matmul_loop_holds_a_steps_gathered_weights_not_the_layouts():
  """The compiled forward+backward of the routed experts: gathering every block's expert
  matrix at once holds [blocks, embed, expert_mlp] copies (271 blocks x 256 KiB a matrix
  here); in steps of 8 blocks (`moe_block_chunk`) the temporaries are tens of MiB fewer."""
  n, num_experts, k = 2048, 16, 2
  rng = np.random.default_rng(0)
  experts = jnp.asarray(np.stack([rng.choice(num_experts, k, replace=False) for _ in range(n)]),
                        jnp.int32)
  weights = jnp.full((n, k), 0.5, jnp.float32)
  cfg = _cfg(num_experts, k=k, dispatch="blocked", block=16, hidden=256, mlp=256, shared=0)
  p = {key: v for key, v in moe.init(jax.random.key(0), cfg).items()
       if key in ("wi_gate", "wi_up", "wo")}
  x = jax.random.normal(jax.random.key(1), (n, cfg.hidden_size))

  def temp_bytes(chunk):
    c = cfg.replace(moe_block_chunk=chunk)
    grad = jax.grad(lambda p, x: jnp.sum(moe.routed_experts(p, x, weights, experts, c) ** 2),
                    argnums=(0, 1))
    return jax.jit(grad).lower(p, x).compile().memory_analysis().temp_size_in_bytes

  whole, steps = temp_bytes(0), temp_bytes(8)
  per_matrix = 271 * cfg.hidden_size * cfg.moe_intermediate_size * 4
  assert whole - steps > per_matrix, (whole, steps, per_matrix)


def test_block_size_keeps_padded_rows_under_twice_the_pairs():
  for pairs, experts, max_block in [(2048, 8, 128), (2048, 64, 128), (16, 256, 128),
                                    (512, 256, 128), (100_000, 256, 128), (7, 3, 4)]:
    b = moe.block_size(pairs, experts, max_block)
    assert 1 <= b <= max_block
    rows = (pairs + min(experts, pairs) * (b - 1)) // b * b
    assert rows < 2 * pairs + b, (pairs, experts, b, rows)
  assert moe.block_size(2048, 8, 128) == 128


def test_unknown_dispatch_is_rejected_with_its_name():
  with pytest.raises(ValueError, match="moe_dispatch.*'grouped'"):
    _cfg(8, dispatch="grouped")
  with pytest.raises(ValueError, match="moe_block_size"):
    _cfg(8, block=0)
  with pytest.raises(ValueError, match="moe_block_chunk"):
    _cfg(8).replace(moe_block_chunk=-2)


def _one_device_and_mesh(cfg, x, rules_kind="rows", x_on_mesh=True):
  """The MoE's outputs, logits and gradients of a loss on one device and on a (2, 2, 2, 1)
  mesh of 8 CPU devices (rules: "rows", or "context_parallel" over fsdp x expert), with the
  mesh's compiled forward HLO: (one device's (out, logits, grads), the mesh's, hlo). x is laid
  out by the activation rules (`x_on_mesh`) or replicated."""
  from jax.sharding import NamedSharding
  from models import sharding
  p = moe.init(jax.random.key(0), cfg)
  loss = lambda p, x: jnp.sum(moe.forward(p, x, cfg)[0] ** 2) + jnp.sum(moe.forward(p, x, cfg)[1])
  fwd = jax.jit(lambda p, x: moe.forward(p, x, cfg))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  one = (*fwd(p, x), grad(p, x))
  c = base.get_config()
  c.mesh.shape = (2, 2, 2, 1)
  rules = sharding.rules_from_config(c.mesh.rules)
  if rules_kind == "context_parallel":
    rules = sharding.context_parallel_rules(rules, ("fsdp", "expert"))
  mesh = sharding.make_mesh(c.mesh)
  with sharding.use_mesh(mesh, rules):
    p_sh = sharding.tree_shardings(moe.axes(cfg), jax.eval_shape(lambda: p), mesh, rules)
    x_spec = (sharding.logical_to_spec(("batch", "activation_length", None), rules, mesh, x.shape)
              if x_on_mesh else PartitionSpec())
    ps, xs = jax.device_put(p, p_sh), jax.device_put(x, NamedSharding(mesh, x_spec))
    groups = common.token_groups(x.shape)
    on_mesh = (*fwd(ps, xs), grad(ps, xs))
    hlo = jax.jit(lambda p, x: moe.forward(p, x, cfg)[0]).lower(ps, xs).compile().as_text()
  return one, on_mesh, hlo, groups


def _assert_same_moe(got, want):
  (out, logits, grads), (ref_out, ref_logits, ref_grads) = got, want
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rules_kind,dispatch,ep", [("rows", "blocked", "off"),
                                                    ("context_parallel", "blocked", "off"),
                                                    ("rows", "blocked", "on"),
                                                    ("context_parallel", "blocked", "on"),
                                                    ("rows", "gmm", "auto"),
                                                    ("context_parallel", "gmm", "auto"),
                                                    ("rows", "blocked_fused", "auto")])
def test_on_a_mesh_each_device_routes_its_own_tokens_with_the_same_result(rules_kind, dispatch,
                                                                          ep):
  """Under a mesh the tokens are routed and dispatched in the groups the mesh holds them in
  (8 here: rows over data x fsdp x expert, or with context parallelism each row's positions
  over fsdp x expert): outputs, router logits and gradients equal the one-group computation,
  and the compiled program's matmul FLOPs do not grow with the number of groups (no device
  computes another device's tokens). With expert parallelism (`gmm` here by `auto`; `blocked`
  with `on`, its matmuls in a loop of 2 blocks a step that stops after the device's experts'
  blocks), the experts split over `expert` stay split: the tokens move to them."""
  from models import aot
  cfg = _cfg(16, k=2, block=16, dispatch=dispatch).replace(moe_expert_parallel=ep)
  if ep == "on":
    cfg = cfg.replace(moe_block_chunk=2)
  x = jax.random.normal(jax.random.key(1), (8, 32, cfg.hidden_size))
  one, on_mesh, hlo, (axes, gb, gs) = _one_device_and_mesh(cfg, x, rules_kind)
  assert gb * gs == 8 and len(axes) == 3
  _assert_same_moe(on_mesh, one)
  if ep != "off":   # gmm: Pallas' interpreter, whose loops are no measure of the kernel's work
    # Expert parallelism: each device gathers its share of the experts (16 over `expert`'s 2
    # ways: 8), never all 16; the tokens come to them instead.
    gathered = [l for l in hlo.splitlines() if "all-gather(" in l]
    whole, share = [f"[{n},{cfg.hidden_size},{cfg.moe_intermediate_size}]" for n in (16, 8)]
    assert not any(whole in l for l in gathered) and any(share in l for l in gathered)
    return
  p = moe.init(jax.random.key(0), cfg)
  one_hlo = jax.jit(lambda p, x: moe.forward(p, x, cfg)[0]).lower(p, x).compile().as_text()
  # Per device: an eighth of the tokens' work (plus the router and padding of smaller groups).
  assert aot.hlo_costs(hlo)["flops"] < 0.35 * aot.hlo_costs(one_hlo)["flops"]


@pytest.mark.parametrize("step,fused", [(600, False), (7, False), (600, True)])
def test_blocked_weight_gradient_of_bfloat16_experts_is_summed_in_float32(step, fused):
  """One expert's rows span 600 one-row blocks: its weight gradient is their sum. Each block's
  product may be rounded to bfloat16 once (independent errors of half an ulp, which add up like
  a random walk: ~2^-9 x the root sum of squares of the terms), but the sum runs in float32 and
  is rounded once. A bfloat16 running sum (autodiff of the gather) rounds at every one of the
  600 additions to the ulp of the partial sum: 5.7-9.5x this bound on these seeds, against
  0.5-0.8x for the float32 sum. In steps of 7 blocks (`moe_block_chunk`), the sum is the
  loop's float32 carry. `blocked_fused`: the kernel's float32 sum, stored in bfloat16."""
  rng = np.random.default_rng(0)
  g, d_in, d_out, e = 600, 4, 4, 2
  xs = jnp.asarray(rng.normal(size=(g, 1, d_in)), jnp.bfloat16)
  dy = jnp.asarray(rng.normal(size=(g, 1, d_out)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(e, d_in, d_out)), jnp.bfloat16)
  block_expert = jnp.zeros((g,), jnp.int32)          # every block is expert 0's
  _, vjp = jax.vjp(lambda w: moe._expert_matmul(xs, w, block_expert, step, fused), w)
  (dw,) = vjp(dy)
  assert dw.dtype == jnp.bfloat16
  terms = jnp.einsum("gbi,gbo->gio", xs.astype(jnp.float32), dy.astype(jnp.float32))
  exact = terms.sum(0)
  bound = 2.0 ** -9 * (4 * jnp.sqrt((terms ** 2).sum(0)) + jnp.abs(exact))
  err = jnp.abs(dw[0].astype(jnp.float32) - exact)
  assert bool(jnp.all(err <= bound)), float(jnp.max(err / bound))
  assert float(jnp.max(jnp.abs(dw[1].astype(jnp.float32)))) == 0.0   # no block: no gradient


@pytest.mark.parametrize("case", ["spread", "one_expert", "empty_experts"])
def test_grouped_matmul_dispatch_matches_ragged_dot_outputs_and_gradients(case):
  """`gmm` (jax's TPU grouped-matmul kernel, run by Pallas' interpreter here): the same
  outputs and gradients as ragged_dot, rows padded to the kernel's row tile included (75
  tokens x k is no multiple of 128)."""
  experts, weights, ref_cfg, p, x, loss = _routed_problem(case, 1)
  cfg = ref_cfg.replace(moe_dispatch="gmm")
  out_ref = moe.routed_experts(p, x, weights, experts, ref_cfg)
  out = jax.jit(lambda p, x, w: moe.routed_experts(p, x, w, experts, cfg))(p, x, weights)
  scale = float(jnp.max(jnp.abs(out_ref)))
  np.testing.assert_allclose(out, out_ref, atol=1e-5 * scale, rtol=0)
  g_ref = jax.grad(loss(ref_cfg), argnums=(0, 1, 2))(p, x, weights)
  g = jax.jit(jax.grad(loss(cfg), argnums=(0, 1, 2)))(p, x, weights)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-12, rtol=0)


def test_auto_dispatch_on_tpu_is_the_grouped_matmul_where_its_tiles_fit():
  from models import config as config_lib
  wide, narrow = _cfg(8, hidden=256, mlp=128), _cfg(8, hidden=64, mlp=64)
  with config_lib.compiling_for("tpu"):
    assert moe.dispatch_of(wide) == "gmm"
    assert moe.dispatch_of(narrow) == "blocked"          # auto falls back
    with pytest.raises(ValueError, match="multiples of 128, got 64 and 64"):
      moe.dispatch_of(narrow.replace(moe_dispatch="gmm"))
  for platform in ("cpu", "gpu"):
    with config_lib.compiling_for(platform):
      assert moe.dispatch_of(wide) == "blocked"
  assert moe.dispatch_of(narrow.replace(moe_dispatch="gmm")) == "gmm"   # the interpreter here


@pytest.mark.parametrize("dispatch,ep", [("gmm", "auto"), ("blocked", "auto"), ("blocked", "off"),
                                         ("blocked_fused", "auto")])
def test_tokens_no_mesh_axis_splits_are_computed_by_the_devices_holding_their_experts(dispatch, ep):
  """One row (a rollout engine's prefill of a prompt) on a mesh of 8 whose batch axes cannot
  split it: every device holds every token. The experts split over `expert` stay split, each
  device computes its experts' pairs and the partial sums are added (no all-gather of the
  whole experts); `off` leaves the blocked dispatch to XLA's partitioner, as before. `gmm`
  here was refused outright ("Mosaic kernels cannot be automatically partitioned"). Outputs,
  logits and gradients equal one device's."""
  cfg = _cfg(16, k=2, block=16, dispatch=dispatch).replace(moe_expert_parallel=ep)
  x = jax.random.normal(jax.random.key(1), (1, 48, cfg.hidden_size))
  one, on_mesh, hlo, (axes, _, _) = _one_device_and_mesh(cfg, x, x_on_mesh=False)
  assert axes == ()
  _assert_same_moe(on_mesh, one)
  whole = f"[16,{cfg.hidden_size},{cfg.moe_intermediate_size}]"
  if ep != "off":
    assert not any(whole in l for l in hlo.splitlines() if "all-gather(" in l)


def test_expert_parallelism_is_chosen_where_the_gathered_tokens_cost_less_than_the_experts():
  """`moe_expert_parallel=auto`: tokens move to the experts where the rows gathered from the
  expert ways are fewer than the layer's expert weights (Qwen3.5-397B-A17B's 160k rows over
  512 devices, 640 tokens a device), and the experts move to the tokens where the rows would be
  the larger (35B-A3B's over 32 devices, 10,240 tokens a device); on and off force it."""
  from models import presets
  def cfg(name, **kw):
    m = base.get_model_config()
    m.update(presets.preset(name))
    m.update(kw)
    return qwen3_5.config_from_dict(m)

  big, mid = cfg("qwen3_5_397b_a17b"), cfg("qwen3_5_35b_a3b")
  assert moe.expert_parallel(big, 8, 640)
  assert not moe.expert_parallel(mid, 8, 10_240)
  assert moe.expert_parallel(cfg("qwen3_5_35b_a3b", moe_expert_parallel="on"), 8, 10_240)
  assert not moe.expert_parallel(cfg("qwen3_5_397b_a17b", moe_expert_parallel="off"), 8, 640)


@pytest.mark.parametrize("impl", ["_top_k_by_rank", "_top_k_by_argmax"])
@pytest.mark.parametrize("shape,k,dtype", [((300, 16), 3, "float32"), ((2, 50, 64), 8, "float32"),
                                           ((40, 8), 8, "float32"), ((6, 256), 8, "bfloat16")])
def test_top_k_without_a_sort_equals_lax_top_k_ties_included(impl, shape, k, dtype):
  rng = np.random.default_rng(0)
  probs = jax.nn.softmax(jnp.asarray(rng.normal(size=shape), jnp.float32), axis=-1)
  probs = probs.at[..., 5].set(probs[..., 2]).astype(dtype)    # ties: the lower index first
  top_k = getattr(moe, impl)
  vals, idx = top_k(probs, k)
  ref_vals, ref_idx = jax.lax.top_k(probs, k)
  np.testing.assert_array_equal(idx, ref_idx)
  np.testing.assert_array_equal(vals, ref_vals)
  assert vals.dtype == probs.dtype and idx.dtype == jnp.int32
  g = jax.grad(lambda p: jnp.sum(top_k(p, k)[0].astype(jnp.float32) * jnp.arange(k)))(probs)
  g_ref = jax.grad(lambda p: jnp.sum(jax.lax.top_k(p, k)[0].astype(jnp.float32)
                                     * jnp.arange(k)))(probs)
  np.testing.assert_array_equal(g, g_ref)


def test_top_k_ranks_a_decode_steps_tokens_and_takes_argmax_passes_for_a_training_steps():
  """`moe.top_k` by rank up to `TOP_K_RANK_MAX` comparisons (tokens x experts^2), so a decode
  step's router is one pass; a training step's tokens take the argmax passes (the rank's
  comparison at 16,384 x 256^2 would be held whole on XLA:CPU and compiled for minutes)."""
  def argmaxes(shape):
    jaxpr = jax.make_jaxpr(lambda p: moe.top_k(p, 8))(jax.ShapeDtypeStruct(shape, jnp.float32))
    return str(jaxpr).count("argmax")
  assert argmaxes((128, 256)) == 0
  assert argmaxes((16_384, 256)) == 8


def test_top_k_by_rank_gives_indices_in_range_when_a_probability_is_nan():
  """A NaN compares false both ways, so ranks no longer number the experts once each: the
  picks' indices stay experts' indices (a kernel reading an expert's matrix by it)."""
  probs = jnp.full((3, 16), 1 / 16).at[0, 4].set(jnp.nan).at[1].set(jnp.nan)
  _, idx = moe._top_k_by_rank(probs, 4)
  assert bool(jnp.all((idx >= 0) & (idx < 16)))


def test_a_decode_steps_router_is_fewer_kernels_by_rank_for_an_h200():
  """The router's softmax and top-8 of 256 experts at 8 tokens, compiled for one H200 from this
  CPU: by rank a few kernels, by argmax passes about one a pass (a decode step is launch-bound:
  docs/results.md)."""
  device = aot.target_devices("h200:1x1")[0]
  p = jax.ShapeDtypeStruct((8, 256), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))

  def kernels(top_k):
    with config_lib.compiling_for("gpu"):
      text = jax.jit(lambda p: top_k(jax.nn.softmax(p, axis=-1), 8)).lower(p).compile().as_text()
    return aot.hlo_costs(text)["kernels"]
  by_rank, by_argmax = kernels(moe._top_k_by_rank), kernels(moe._top_k_by_argmax)
  assert by_rank <= 3 < 8 <= by_argmax


@pytest.mark.parametrize("n,groups", [(1, 4), (1000, 7), (5000, 256)])
def test_rank_in_group_is_a_stable_sorts_position_within_each_group(n, groups):
  ids = np.random.default_rng(n).integers(0, groups, size=n)
  rank, sizes = jax.jit(moe.rank_in_group, static_argnums=1)(jnp.asarray(ids), groups)
  order = np.argsort(ids, kind="stable")
  starts = np.cumsum(np.bincount(ids, minlength=groups)) - np.bincount(ids, minlength=groups)
  expected = np.empty(n, np.int64)
  expected[order] = np.arange(n) - starts[ids[order]]
  np.testing.assert_array_equal(rank, expected)
  np.testing.assert_array_equal(sizes, np.bincount(ids, minlength=groups))


def test_blocked_moe_forward_and_backward_have_no_sort():
  """The blocked dispatch's routing and layout compile without a sort (`moe.top_k`,
  `moe.rank_in_group`): compiled for a GPU from a machine without one, XLA:GPU's own sort
  kernels made most of a full-size step's compile time."""
  cfg = _cfg(16, k=4, dispatch="blocked", block=8)
  p = moe.init(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (2, 64, cfg.hidden_size))
  grad = jax.grad(lambda p, x: jnp.sum(moe.forward(p, x, cfg)[0] ** 2), argnums=(0, 1))
  text = jax.jit(grad).lower(p, x).as_text()
  assert "stablehlo.sort" not in text and "top_k" not in text


def test_the_block_layout_has_no_loop_and_gives_each_block_its_expert():
  """`blocked_layout` finds each block's expert by one compare against every expert's end, not
  a binary search (a loop of log2(E) + 1 steps, each a few GPU kernels): its program has no loop
  but `rank_in_group`'s, and the experts are those the rows say, empty experts included."""
  experts = jnp.asarray([[3, 0], [3, 5], [0, 3], [7, 3]], jnp.int32)
  layout = jax.jit(moe.blocked_layout, static_argnums=(1, 2))
  loops = lambda f, *a: jax.jit(f, static_argnums=tuple(range(1, len(a)))).lower(
      *a).as_text().count("stablehlo.while")
  assert loops(moe.blocked_layout, experts, 8, 2) == loops(moe.rank_in_group, experts.reshape(-1), 8)
  assert loops(moe.rank_in_group, experts.reshape(-1), 8) <= 1
  pos_of_pair, row_token, row_valid, block_expert, used = layout(experts, 8, 2)
  rows_expert = np.asarray(block_expert).repeat(2)[np.asarray(pos_of_pair)]
  np.testing.assert_array_equal(rows_expert, np.asarray(experts).reshape(-1))
  assert int(used) == 5 and list(np.asarray(block_expert)[:5]) == [0, 3, 3, 5, 7]


@pytest.mark.parametrize("case", ["spread", "empty_experts"])
def test_the_fused_blocked_matmul_gives_the_blocked_dispatchs_values_and_gradients(case):
  """`blocked_fused` (each expert matmul a Pallas kernel reading the block's expert in place;
  Pallas' interpreter here): the outputs and gradients of ragged_dot, for blocks of 1 row
  (padded to Triton's 16), 8 and the largest the tokens allow."""
  experts, weights, ref_cfg, p, x, loss = _routed_problem(case, 3)
  out_ref = moe.routed_experts(p, x, weights, experts, ref_cfg)
  g_ref = jax.grad(loss(ref_cfg), argnums=(0, 1, 2))(p, x, weights)
  scale = float(jnp.max(jnp.abs(out_ref)))
  for block in (1, 8, 128):
    cfg = ref_cfg.replace(moe_dispatch="blocked_fused", moe_block_size=block)
    out = jax.jit(lambda p, x, w: moe.routed_experts(p, x, w, experts, cfg))(p, x, weights)
    np.testing.assert_allclose(out, out_ref, atol=1e-5 * scale, rtol=0, err_msg=f"block {block}")
    g = jax.jit(jax.grad(loss(cfg), argnums=(0, 1, 2)))(p, x, weights)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
      np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-12, rtol=0)


def test_the_fused_matmul_reads_one_layer_of_stacked_experts_and_skips_unused_blocks():
  """`moe_fused.block_matmul` on every layer's experts [layers, experts, d_in, d_out] with a
  layer index (as a decode step hands them) is that layer's blocked matmul; blocks from
  `used_blocks` on are zeros."""
  rng = np.random.default_rng(4)
  w = jnp.asarray(rng.standard_normal((3, 5, 64, 32)), jnp.float32)
  xs = jnp.asarray(rng.standard_normal((6, 4, 64)), jnp.float32)
  block_expert = jnp.asarray([0, 1, 1, 3, 4, 4], jnp.int32)
  got = jax.jit(moe_fused.block_matmul)(xs, w, block_expert, jnp.int32(4), jnp.int32(2))
  want = jnp.einsum("gbi,gio->gbo", xs, w[2][block_expert], precision="highest")
  np.testing.assert_allclose(got[:4], want[:4], atol=1e-4)
  assert not np.any(np.asarray(got[4:]))


@pytest.mark.parametrize("rows", [1, 4])
def test_the_fused_swiglu_is_xlas_three_ops_on_one_layer_of_stacked_experts(rows):
  """`moe_fused.block_swiglu` (a decode step's gate and up with their product, one kernel) on
  every layer's experts with a layer index: silu(xs @ w_gate) * (xs @ w_up) of that layer's
  matrices in bfloat16, each product rounded as XLA's separate matmuls store it, for one-row
  blocks (a decode step's pairs) and blocks of rows; blocks from `used_blocks` on and of expert
  -1 are zeros."""
  rng = np.random.default_rng(5)
  bf = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.2, jnp.bfloat16)
  w_gate, w_up, xs = bf(3, 5, 64, 32), bf(3, 5, 64, 32), bf(6, rows, 64)
  block_expert = jnp.asarray([0, 1, -1, 3, 4, 4], jnp.int32)
  got = jax.jit(moe_fused.block_swiglu)(xs, w_gate, w_up, block_expert, jnp.int32(5),
                                        jnp.int32(2))
  mm = lambda w: jnp.einsum("gbi,gio->gbo", xs, w[2][block_expert], precision="highest",
                            preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  want = jax.nn.silu(mm(w_gate)) * mm(w_up)
  assert got.dtype == jnp.bfloat16
  live = np.asarray([0, 1, 3, 4])
  np.testing.assert_allclose(np.float32(got[live]), np.float32(want[live]),
                             atol=2 ** -7 * float(jnp.abs(want.astype(jnp.float32)).max()))
  assert not np.any(np.asarray(got[np.asarray([2, 5])], np.float32))
  # Blocks 2i and 2i+1 reading xs[i] (`x_every`: a decode step's pairs of one token).
  every = jax.jit(moe_fused.block_swiglu, static_argnames="x_every")(
      xs[::2], w_gate, w_up, block_expert, jnp.int32(5), jnp.int32(2), x_every=2)
  again = jax.jit(moe_fused.block_swiglu)(jnp.repeat(xs[::2], 2, axis=0), w_gate, w_up,
                                          block_expert, jnp.int32(5), jnp.int32(2))
  np.testing.assert_array_equal(np.float32(every), np.float32(again))


@pytest.mark.parametrize("experts,k", [(64, 2), (256, 8), (512, 10)])
def test_the_fused_decode_routing_gives_routes_values_ties_included(experts, k):
  """`moe_fused.route` (a decode step's routing, one kernel, on every layer's stacked router
  with the layer's index) gives `moe.route`'s logits, weights and expert ids from bfloat16
  tokens and router: ties (two equal router columns) to
  the lower index as `lax.top_k`, k not a power of two (397B-A17B's top-10), a row of NaN
  logits still routed to experts in range."""
  rng = np.random.default_rng(6)
  w = rng.standard_normal((128, experts)) * 0.1
  w[:, 5] = w[:, 3]                                            # experts 3 and 5 always tie
  x = jnp.asarray(rng.standard_normal((8, 128)), jnp.bfloat16).at[0, :].set(
      jnp.asarray(5.0 * w[:, 3] / np.linalg.norm(w[:, 3]), jnp.bfloat16))   # row 0 picks them
  w = jnp.asarray(w, jnp.bfloat16)
  cfg = _cfg(experts, k=k, hidden=128)
  want = moe.route(w, x, cfg)
  stack = jnp.stack([w * 0, w, w * 2])                         # the layer read is 1
  got = jax.jit(lambda x, w: moe.route(w, x, cfg, jnp.int32(1)))(x, stack)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[2], want[2])
  assert list(np.asarray(got[2][0, :2])) == [3, 5]
  _, _, ids = jax.jit(lambda x, w: moe.route(w, x, cfg, jnp.int32(1)))(
      x.at[1, 0].set(jnp.nan), stack)
  assert np.all((np.asarray(ids) >= 0) & (np.asarray(ids) < experts))


def test_a_decode_step_with_fewer_pairs_than_experts_runs_each_pair_as_its_own_block():
  """`blocked_fused` at decode (every layer's stacked experts and router, a layer index) with fewer
  (token, slot) pairs than experts, where the layout's blocks are single rows: each pair is its
  own block in token order, no sorting, counting or scattering (no scatter in the program:
  the layout's places its rows by one); the values are the blocked dispatch's on that layer's experts, and under expert
  parallelism (`first_expert`) the pairs of other devices' experts add nothing."""
  cfg = _cfg(32, k=2, dispatch="blocked_fused", shared=0)      # 8 tokens: 16 pairs < 32 experts
  p = moe.init(jax.random.key(0), cfg)
  routed = ("wi_gate", "wi_up", "wo")
  stacked = dict(p, **{k: jnp.stack([p[k] * (1.0 + 0.5 * i) for i in range(3)])
                       for k in ("router", *routed)})
  layer1 = dict(p, **{k: stacked[k][1] for k in ("router", *routed)})
  x = jax.random.normal(jax.random.key(1), (8, 1, cfg.hidden_size))
  blocked = cfg.replace(moe_dispatch="blocked")
  want = moe.forward(layer1, x, blocked)[0]
  fused = jax.jit(lambda p, x: moe.forward(p, x, cfg, layer=jnp.int32(1))[0])
  np.testing.assert_allclose(fused(stacked, x), want, atol=1e-5 * float(jnp.max(jnp.abs(want))))
  assert "scatter" not in fused.lower(stacked, x).as_text()
  assert "scatter" in jax.jit(lambda p, x: moe.forward(p, x, blocked)[0]).lower(layer1, x).as_text()
  # A device holding experts 8..15 of each layer: only the pairs routed there.
  flat = x.reshape(8, -1)
  _, weights, experts = moe.route(p["router"], flat, cfg)
  share = dict(stacked, **{k: stacked[k][:, 8:16] for k in routed})
  got = moe._pair_experts(share, flat, weights, experts, cfg, 8, jnp.int32(1))
  mine = (experts >= 8) & (experts < 16)
  want_share = moe.routed_experts(layer1, flat, jnp.where(mine, weights, 0.0), experts, blocked)
  assert np.any(np.asarray(mine)) and not np.all(np.asarray(mine))
  np.testing.assert_allclose(got, want_share, atol=1e-5 * float(jnp.max(jnp.abs(want_share))))


def test_the_fused_backward_kernels_give_the_transposed_matmul_and_per_expert_weight_sums():
  """The backward of `blocked_fused`: `block_matmul(transpose=True)` is each block's rows
  against its expert's matrix transposed, and `expert_weight_grads` each expert's sum of x^T dy
  over its blocks (float32): blocks of one expert run contiguous, an expert with no block gets
  zeros, blocks from `used_blocks` on are left out; one row (no dot) and 4 (padded to 16) too."""
  rng = np.random.default_rng(5)
  block_expert = jnp.asarray([0, 0, 0, 2, 3, 3, 4, 4], jnp.int32)   # expert 1 has no block
  for rows in (1, 4, 32):
    xs = jnp.asarray(rng.standard_normal((8, rows, 64)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((8, rows, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 64, 32)), jnp.float32)
    dx = jax.jit(lambda d, w: moe_fused.block_matmul(d, w, block_expert, jnp.int32(7),
                                                     transpose=True))(dy, w)
    want_dx = jnp.einsum("gbo,gio->gbi", dy, w[block_expert], precision="highest")
    np.testing.assert_allclose(dx[:7], want_dx[:7], atol=1e-4)
    assert not np.any(np.asarray(dx[7:]))
    dw = jax.jit(lambda x, d: moe_fused.expert_weight_grads(x, d, block_expert, 5,
                                                            jnp.int32(7)))(xs, dy)
    per_block = np.einsum("gbi,gbo->gio", np.asarray(xs[:7], np.float64), np.asarray(dy[:7]))
    want_dw = np.zeros((5, 64, 32))
    np.add.at(want_dw, np.asarray(block_expert[:7]), per_block)
    assert dw.dtype == jnp.float32 and not np.any(np.asarray(dw[1]))
    np.testing.assert_allclose(dw, want_dw, atol=1e-4, err_msg=f"rows {rows}")
    # Stored in bfloat16: the same float32 sums, each rounded once.
    dw16 = jax.jit(lambda x, d: moe_fused.expert_weight_grads(
        x, d, block_expert, 5, jnp.int32(7), jnp.bfloat16))(xs, dy)
    assert dw16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(dw16, dw.astype(jnp.bfloat16))


def _h200_moe_grad_hlo(cfg) -> str:
  """The gradient of the MoE block (512 tokens) compiled for one H200 from this CPU."""
  on = jax.sharding.SingleDeviceSharding(aot.target_devices("h200:1x1")[0])
  shaped = lambda tree: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), tree)
  p = shaped(jax.eval_shape(lambda: moe.init(jax.random.key(0), cfg)))
  x = jax.ShapeDtypeStruct((2, 256, cfg.hidden_size), jnp.float32, sharding=on)
  loss = lambda p, x: jnp.sum(moe.forward(p, x, cfg)[0] ** 2)
  with config_lib.compiling_for("gpu"):
    return jax.jit(jax.grad(loss)).lower(p, x).compile().as_text()


def test_the_gpu_training_step_with_fused_experts_makes_no_per_block_expert_matrix():
  """moe_dispatch=blocked_fused, the MoE's gradient compiled for an H200: no array of one
  expert matrix a block ([blocks, d_in, d_out]: the gathers of the forward and backward, the
  per-block weight gradients and their scatter-add), which `blocked` has, and no loop; the only
  expert-matrix-shaped results are the kernels' [experts, d_in, d_out] weight gradients."""
  cfg = _cfg(8, block=16, hidden=64, mlp=32, shared=0)
  per_block = re.compile(r"= [a-z0-9]+\[(\d+),(?:64,32|32,64)\]")
  shaped = lambda hlo: [(int(m.group(1)), line) for line in hlo.splitlines()
                        if (m := per_block.search(line)) and "parameter(" not in line]
  blocked = _h200_moe_grad_hlo(cfg.replace(moe_dispatch="blocked"))
  assert any(n != 8 for n, _ in shaped(blocked)) and "scatter(" in blocked
  fused = _h200_moe_grad_hlo(cfg.replace(moe_dispatch="blocked_fused"))
  assert all(n == 8 and "custom-call(" in line for n, line in shaped(fused)), shaped(fused)
  assert " while(" not in fused


@pytest.mark.parametrize("dispatch", ["blocked", "blocked_fused"])
def test_on_a_gpu_mesh_experts_gathered_whole_move_in_bfloat16_and_come_back_reduce_scattered(
    dispatch):
  """The experts gathered whole to each device's tokens (rows split by position over 8 H200s,
  compiled from this CPU; float32 weights, bfloat16 compute): every all-gather of an expert
  matrix moves it in bfloat16, forward and backward, and each device's gradient of every expert
  comes back to the experts' own layout as a float32 reduce-scatter, half the bytes over the
  links of an all-reduce; no all-reduce moves an expert matrix. Left to XLA (a vmap for
  `blocked`, the kernels' shard_map for `blocked_fused`) this step gathered float32 weights or
  all-reduced whole float32 gradients, and 35B-A3B's RL step on 16 H200 with `blocked_fused`
  did both (17k GiB of float32 all-gathers and 15.7k of all-reduces a GPU a step; compiler
  figures, docs/results.md)."""
  from jax.sharding import NamedSharding
  from models import sharding
  cfg = _cfg(8, dispatch=dispatch, hidden=64, mlp=32, shared=0, block=16).replace(
      moe_expert_parallel="off", dtype="bfloat16")
  c = base.get_config()
  rules = sharding.context_parallel_rules(sharding.rules_from_config(c.mesh.rules),
                                          ("fsdp", "expert"))
  mesh = jax.sharding.Mesh(np.array(aot.target_devices("h200:1x8")).reshape(1, 2, 4, 1),
                           c.mesh.axes, axis_types=(jax.sharding.AxisType.Auto,) * 4)
  with sharding.use_mesh(mesh, rules), config_lib.compiling_for("gpu"):
    shapes = jax.eval_shape(lambda: moe.init(jax.random.key(0), cfg))
    specs = jax.tree.map(lambda a, axes: sharding.logical_to_spec(axes, rules, mesh, a.shape),
                         shapes, moe.axes(cfg), is_leaf=sharding.is_axes_leaf)
    p = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                       sharding=NamedSharding(mesh, s)),
                     shapes, specs)
    x = jax.ShapeDtypeStruct((2, 256, cfg.hidden_size), jnp.bfloat16, sharding=NamedSharding(
        mesh, sharding.logical_to_spec(("batch", "activation_length", None), rules, mesh)))
    loss = lambda p, x: jnp.sum(moe.forward(p, x, cfg)[0].astype(jnp.float32) ** 2)
    hlo = jax.jit(jax.grad(loss)).lower(p, x).compile().as_text()
  expert_matrix = 8 * 64 * 32

  def moved(kind):
    """(dtype, elements) of each array a `kind` collective returns."""
    return [(dt, math.prod(d)) for line in hlo.splitlines()
            if f" {kind}(" in line or f" {kind}-start(" in line
            for dt, d in aot._arrays(line.split(" = ", 1)[1].split(f" {kind}")[0])]

  gathered = [dt for dt, n in moved("all-gather") if n >= expert_matrix]
  assert gathered and set(gathered) == {"bf16"}, moved("all-gather")
  assert max((n for _, n in moved("all-reduce")), default=0) < expert_matrix, moved("all-reduce")
  scattered = [dt for dt, n in moved("reduce-scatter") if n >= expert_matrix]
  assert scattered and set(scattered) == {"f32"}, moved("reduce-scatter")


def test_the_fused_dispatch_is_an_error_on_tpu():
  cfg = _cfg(8, dispatch="blocked_fused")
  p = moe.init(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (2, 16, cfg.hidden_size))
  with config_lib.compiling_for("tpu"), pytest.raises(ValueError, match="blocked_fused"):
    moe.forward(p, x, cfg)


def test_the_shared_gate_of_an_unrolled_layer_stack_compiles_for_an_h200():
  """Two layers' MoE in bfloat16, each reading its slice of stacked params (as an unrolled
  layer scan does), forward and backward over 8 x 2048 tokens compile for an H200: the shared
  expert's one-column gate matmul, which XLA:GPU's Triton GEMM emitter failed on here ("Reshape
  input and output shapes must be the same"), is a float32 weighted sum."""
  cfg = _cfg(4, k=1, hidden=1024, mlp=16, shared=16).replace(dtype="bfloat16",
                                                              param_dtype="bfloat16")
  one = jax.eval_shape(lambda k: moe.init(k, cfg), jax.random.key(0))
  stacked = jax.tree.map(lambda a: jax.ShapeDtypeStruct((2,) + a.shape, a.dtype), one)
  x = jax.ShapeDtypeStruct((8, 2048, cfg.hidden_size), jnp.bfloat16)

  def loss(ps, x):
    for i in range(2):
      x = x + moe.forward(jax.tree.map(lambda a: a[i], ps), x, cfg)[0]
    return jnp.sum(x.astype(jnp.float32))
  device = aot.target_devices("h200:1x1")[0]
  place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                         sharding=jax.sharding.SingleDeviceSharding(device))
  with config_lib.compiling_for("gpu"):
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    hlo = step.lower(*jax.tree.map(place, (stacked, x))).compile().as_text()
  assert "__triton_nested_gemm_fusion" in hlo or "__cublas" in hlo


def test_the_shared_gates_written_gradient_is_autodiffs():
  """`_gate_logit`'s hand-written VJP (which keeps x in its own dtype) gives autodiff's
  gradients of x . w, for both operands, on a cotangent that is data."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 5, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((16,)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((2, 5, 1)), jnp.float32)
  plain = lambda x, w: jnp.einsum("bte,e->bt", x, w, precision="highest")[..., None]
  want = jax.vjp(plain, x, w)[1](g)
  got = jax.vjp(moe._gate_logit, x, w)[1](g)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(moe._gate_logit(x, w), plain(x, w), rtol=1e-5, atol=1e-6)
