"""Forward+backward throughput of the jitted model vs transformers on the same config and batch,
and compile time of an 8-layer vs a 40-layer model of the same width.

  python benchmarks/model_step.py                 # CPU, tiny-width MoE
  python benchmarks/model_step.py --hidden=1024 --dtype=bfloat16 --no_torch   # on an accelerator
  python benchmarks/model_step.py --breakdown --hidden=256 --seq=1024   # + time per component

The JAX step (and each component of the breakdown) compiles with the train step's
`train.xla_cpu_dots` (models/xla_flags.py; `--xla_cpu_dots=ynnpack` for XLA:CPU's default).
Prints one line per figure and a JSON summary as the last line. The ratio to transformers (and
the tokens/s in the JSON line) comes from both steps timed in alternating rounds, medians, with
the smallest and largest round's ratio beside it (`side_by_side`); each side's first timing,
one after the other, is printed too.

With --breakdown the step is also taken apart: each component (embedding, LM head + loss, the
RMSNorms, the Gated DeltaNet layer and its chunked delta rule, the attention layer, the MoE
block and its routing, routed experts (and their dispatch / expert matmuls / combine) and
shared expert) runs as its own jitted function on the shapes it has inside the model, forward
and forward+backward, beside the matching module of transformers' Qwen3.5 MoE built from the
same weights, timed in alternating rounds in one process (each round: every JAX function,
then every torch one; medians over rounds). The table gives
ms per call and the number of layers each counts for; the whole step minus the sum of the
top-level parts x layers is the layer scan and glue overhead. The table is in the JSON line
under "breakdown".
"""
import argparse
import functools
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import device_memory  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])

if __name__ == "__main__":
  device_memory.set_policy()  # before jax loads: this process's allocator (device_memory.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_overrides as overrides  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])
from configs import base  # noqa: E402
from models import qwen3_5  # noqa: E402
from models.config import FULL, LINEAR  # noqa: E402
from models.layers import attention  # noqa: E402
from models.layers import common  # noqa: E402
from models.layers import gated_deltanet  # noqa: E402
from models.layers import moe  # noqa: E402
from models.layers import norm  # noqa: E402
from models import xla_flags  # noqa: E402


def _cfg(args, layers):
  m = base.get_model_config()
  m.update(num_hidden_layers=layers, hidden_size=args.hidden, vocab_size=args.vocab,
           num_attention_heads=args.heads, num_key_value_heads=2, head_dim=args.head_dim,
           linear_num_key_heads=args.heads // 2, linear_num_value_heads=args.heads,
           linear_key_head_dim=args.head_dim, linear_value_head_dim=args.head_dim,
           num_experts=args.experts, num_experts_per_tok=args.topk,
           moe_intermediate_size=args.moe_ffn, shared_expert_intermediate_size=args.moe_ffn,
           param_dtype=args.dtype, dtype=args.dtype)
  # `--set key=value`: any model config key there is (an unknown one is an error).
  overrides.apply(m, [kv[len("model."):] if kv.startswith("model.") else kv for kv in args.set])
  return qwen3_5.config_from_dict(m)


def _loss(cfg, params, tokens):
  logits = qwen3_5.forward(cfg, params, tokens)
  logp = jax.nn.log_softmax(logits[:, :-1])
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def jax_step_time(cfg, tokens, iters, dots, return_step=False):
  params = qwen3_5.init_params(cfg, jax.random.key(0))
  step = jax.jit(jax.value_and_grad(lambda p, t: _loss(cfg, p, t)),
                 compiler_options=xla_flags.compiler_options(dots))
  t0 = time.perf_counter()
  compiled = step.lower(params, tokens).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(params, tokens))
  t0 = time.perf_counter()
  for _ in range(iters):
    out = compiled(params, tokens)
  jax.block_until_ready(out)
  if return_step:
    return ((time.perf_counter() - t0) / iters, compile_s, params,
            lambda: jax.block_until_ready(compiled(params, tokens)))
  return (time.perf_counter() - t0) / iters, compile_s, params


def torch_step_time(cfg, params, tokens, iters, return_model=False):
  import torch  # lazy: the reference only (test dependencies), and heavy
  import transformers  # lazy: the reference only (test dependencies), and heavy
  dtype = getattr(torch, cfg.dtype)
  with tempfile.TemporaryDirectory() as d:
    qwen3_5.save_hf(cfg, params, d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
  model.train()
  t = torch.from_numpy(np.array(tokens)).long()

  def step():
    model.zero_grad()
    logits = model(t).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             t[:, 1:].reshape(-1))
    loss.backward()

  step()
  t0 = time.perf_counter()
  for _ in range(iters):
    step()
  if return_model:
    return (time.perf_counter() - t0) / iters, model, step
  return (time.perf_counter() - t0) / iters


def side_by_side(jax_step, torch_step, rounds, iters):
  """Both whole steps timed in alternating rounds: the ratio that goes in the JSON line.

  Each round times `iters` JAX steps and `iters` torch steps, which side goes first swapping
  from round to round, after a pause that lets torch's OpenMP threads stop spinning (they would
  be billed to a JAX step timed right after). One after the other, the first way above, a drift
  of the machine's load between the two halves shows as a speedup or a slowdown of +-10% from
  run to run here; per round both sides see the same load. Returns the median ms of a step of
  each side, the median of the rounds' ratios (torch / jax) and their smallest and largest.
  """
  jax_ms, torch_ms = [], []
  for r in range(rounds):
    order = ((jax_step, jax_ms), (torch_step, torch_ms))
    for step, times in (order if r % 2 == 0 else order[::-1]):
      time.sleep(0.2)
      _time_ms(step, times, iters)
  ratios = [t / j for j, t in zip(jax_ms, torch_ms)]
  return {"jax_ms": float(np.median(jax_ms)), "torch_ms": float(np.median(torch_ms)),
          "ratio": float(np.median(ratios)), "ratio_range": [min(ratios), max(ratios)]}


# -- --breakdown: the step's time per component, beside transformers' modules ------------------

def _layer_params(params, j):
  """Cycle position j's weights of the first cycle (the leading [cycles] axis dropped)."""
  return jax.tree.map(lambda a: a[0], params["blocks"][j])


def _jax_pair(f, args, argnums, dots):
  """(jitted forward, jitted forward + backward w.r.t. args[argnums]) of f(*args) -> array,
  compiled with `dots` as the step is (models/xla_flags.py)."""
  options = xla_flags.compiler_options(dots)
  fwd = jax.jit(f, compiler_options=options)
  out = jax.eval_shape(f, *args)
  cot = jnp.ones(out.shape, out.dtype)

  def fwd_bwd(*a):
    diff = [a[i] for i in argnums]

    def g(*d):
      full = list(a)
      for i, x in zip(argnums, d):
        full[i] = x
      return f(*full)
    _, vjp = jax.vjp(g, *diff)
    return vjp(cot)
  bwd = jax.jit(fwd_bwd, compiler_options=options)
  return (lambda: jax.block_until_ready(fwd(*args))), (lambda: jax.block_until_ready(bwd(*args)))


def _torch_pair(torch, f, inputs, module):
  """(forward without grad, forward + backward) of f(*inputs) -> tensor; grads of `module`'s
  parameters and of the inputs that require grad."""
  def fwd():
    with torch.no_grad():
      f(*inputs)

  def fwd_bwd():
    if module is not None:
      module.zero_grad(set_to_none=True)
    for x in inputs:
      if isinstance(x, torch.Tensor) and x.requires_grad:
        x.grad = None
    out = f(*inputs)
    out.backward(torch.ones_like(out))
  return fwd, fwd_bwd


def _captured_inputs(torch, model, tokens, modules):
  """The (args, kwargs) each module of `modules` (name -> module) is called with in one forward
  of the whole model on `tokens`."""
  seen, hooks = {}, []
  for name, m in modules.items():
    def hook(mod, args, kwargs, name=name):
      seen.setdefault(name, (args, dict(kwargs)))
    hooks.append(m.register_forward_pre_hook(hook, with_kwargs=True))
  with torch.no_grad():
    model(tokens, use_cache=False)
  for h in hooks:
    h.remove()
  return seen


class _Inputs:
  """What every component's pair of timings is built from: the model's shapes and inputs on the
  JAX side and, with `torch_model`, transformers' modules and their captured inputs."""

  def __init__(self, args, cfg, params, tokens, torch_model):
    self.pair = functools.partial(_jax_pair, dots=args.xla_cpu_dots)
    self.cfg, self.params, self.tokens = cfg, params, tokens
    self.b, self.t = tokens.shape
    self.n = self.b * self.t
    self.dt = cfg.jnp_dtype
    self.x = (jax.random.normal(jax.random.key(3), (self.b, self.t, cfg.hidden_size),
                                jnp.float32)).astype(self.dt)
    self.flat = self.x.reshape(self.n, cfg.hidden_size)
    self.positions = jnp.broadcast_to(jnp.arange(self.t, dtype=jnp.int32), (self.b, self.t))
    self.j_lin = cfg.cycle.index(LINEAR) if LINEAR in cfg.cycle else None
    self.j_att = cfg.cycle.index(FULL) if FULL in cfg.cycle else None
    self.comps = {}
    self.tm = self.torch = None
    if torch_model is not None:
      self._torch_inputs(torch_model)

  def _torch_inputs(self, tm):
    import torch  # lazy: the reference only (test dependencies), and heavy
    self.tm, self.torch = tm, torch
    self.layers = tm.model.layers
    self.t_tokens = torch.from_numpy(np.array(self.tokens)).long()
    self.mods = {"mlp": self.layers[0].mlp}
    if self.j_lin is not None:
      self.mods["gdn"] = self.layers[self.j_lin].linear_attn
    if self.j_att is not None:
      self.mods["attn"] = self.layers[self.j_att].self_attn
    self.seen = _captured_inputs(torch, tm, self.t_tokens, self.mods)
    for _, kwargs in self.seen.values():   # no decode cache: a training step's call
      for k in ("cache_params", "past_key_values"):
        if k in kwargs:
          kwargs[k] = None
    self.tx = torch.from_numpy(np.array(self.x.astype(jnp.float32))).to(tm.dtype).requires_grad_(True)
    self.tflat = self.tx.detach().reshape(self.n, -1).requires_grad_(True)

  def add(self, name, layers_count, jax_pair, torch_pair):
    self.comps[name] = (layers_count, jax_pair, torch_pair)

  def torch_pair(self, f, inputs, module):
    """transformers' side of a component: None without the reference model."""
    return None if self.tm is None else _torch_pair(self.torch, f, inputs, module)


def breakdown_components(args, cfg, params, tokens, torch_model):
  """name -> (layers it counts for, jax (fwd, fwd+bwd), torch (fwd, fwd+bwd) or None).

  Each component runs as its own jitted function on the shapes it has inside the model; the
  torch counterparts are the modules of the transformers model built from the same weights
  (layer j of the first cycle), on the inputs captured from one forward of that model.
  """
  c = _Inputs(args, cfg, params, tokens, torch_model)
  _add_embedding_head_and_norms(c)
  if c.j_lin is not None:
    _add_gated_deltanet(c)
  if c.j_att is not None:
    p = _layer_params(params, c.j_att)["mixer"]
    c.add("attention layer", sum(1 for x in cfg.layer_types if x == FULL),
          c.pair(lambda p, h: attention.forward(p, h, c.positions, cfg)[0], (p, c.x), (0, 1)),
          None if c.tm is None else c.torch_pair(
              lambda h: c.mods["attn"](**dict(c.seen["attn"][1], hidden_states=h))[0], (c.tx,),
              c.mods["attn"]))
  if cfg.use_moe:
    _add_moe(c)
  return c.comps


def _add_embedding_head_and_norms(c: _Inputs) -> None:
  cfg, params, tokens, dt, tm = c.cfg, c.params, c.tokens, c.dt, c.tm
  # Embedding lookup (backward: the scatter into the table's gradient).
  c.add("embedding", 1, c.pair(lambda e, tok: jnp.take(e, tok, axis=0).astype(dt),
                               (params["embed"], tokens), (0,)),
        None if tm is None else c.torch_pair(tm.model.embed_tokens, (c.t_tokens,),
                                             tm.model.embed_tokens))
  # Final norm, LM head and the token cross-entropy.
  def head_loss(p, h):
    h = norm.rms_norm(h, p["final_norm"], cfg.rms_norm_eps)
    logp = jax.nn.log_softmax(qwen3_5.logits_from_hidden(cfg, p, h)[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
  head_p = {k: v for k, v in params.items() if k != "blocks"}
  t_head_loss = None
  if tm is not None:
    def t_head_loss(h):
      logits = tm.lm_head(tm.model.norm(h))
      return c.torch.nn.functional.cross_entropy(
          logits[:, :-1].reshape(-1, logits.shape[-1]), c.t_tokens[:, 1:].reshape(-1))
  c.add("LM head + loss", 1, c.pair(head_loss, (head_p, c.x), (0, 1)),
        None if tm is None else c.torch_pair(t_head_loss, (c.tx,), tm))
  # The two RMSNorms of every layer.
  c.add("RMSNorm (x2 per layer)", 2 * cfg.num_hidden_layers,
        c.pair(lambda w, h: norm.rms_norm(h, w, cfg.rms_norm_eps),
               (params["blocks"][0]["input_norm"][0], c.x), (0, 1)),
        None if tm is None else c.torch_pair(c.layers[0].input_layernorm, (c.tx,),
                                             c.layers[0].input_layernorm))


def _add_gated_deltanet(c: _Inputs) -> None:
  """The Gated DeltaNet layer, and its chunked delta rule alone."""
  cfg, b, t = c.cfg, c.b, c.t
  count = sum(1 for x in cfg.layer_types if x == LINEAR)
  p = _layer_params(c.params, c.j_lin)["mixer"]
  c.add("GDN layer", count,
        c.pair(lambda p, h: gated_deltanet.forward(p, h, cfg)[0], (p, c.x), (0, 1)),
        None if c.tm is None else c.torch_pair(
            lambda h: c.mods["gdn"](**dict(c.seen["gdn"][1], hidden_states=h)), (c.tx,),
            c.mods["gdn"]))
  # The chunked delta rule alone, on the layer's q, k, v, g, beta (l2-norm and head repeat
  # included on both sides: transformers' function does them itself).
  nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
  dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
  ks = jax.random.split(jax.random.key(4), 5)
  q = jax.random.normal(ks[0], (b, t, nk, dk), jnp.float32)
  k = jax.random.normal(ks[1], (b, t, nk, dk), jnp.float32)
  v = jax.random.normal(ks[2], (b, t, nv, dv), jnp.float32)
  g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, nv), jnp.float32))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, nv), jnp.float32))

  chunk = gated_deltanet.chunk_size(cfg)

  def rule(q, k, v, g, beta):
    l2 = lambda z: z * jax.lax.rsqrt(jnp.sum(z * z, -1, keepdims=True) + 1e-6)
    q = jnp.repeat(l2(q), nv // nk, axis=2) * dk ** -0.5
    k = jnp.repeat(l2(k), nv // nk, axis=2)
    state = jnp.zeros((b, nv, dk, dv), jnp.float32)
    return gated_deltanet.chunked_delta_rule(q, k, v, g, beta, state, chunk)[0]
  t_rule = None
  if c.tm is not None:
    fn = sys.modules[type(c.mods["gdn"]).__module__].torch_chunk_gated_delta_rule
    t_in = tuple(c.torch.from_numpy(np.array(a)).requires_grad_(True) for a in (q, k, v, g, beta))
    # Copies in: the function updates some of its inputs' buffers in place, which autograd
    # refuses on leaf tensors (inside the layer its inputs are intermediate results).
    t_rule = c.torch_pair(lambda *a: fn(*(x.clone() for x in a), chunk_size=chunk,
                                        use_qk_l2norm_in_kernel=True)[0], t_in, None)
  c.add("  GDN chunked rule", count, c.pair(rule, (q, k, v, g, beta), (0, 1, 2, 3, 4)), t_rule)


def _add_moe(c: _Inputs) -> None:
  """The MoE block, its routing, its routed experts (and their three parts as the model
  dispatches them) and its shared expert."""
  cfg, flat, dt, tm, layers = c.cfg, c.flat, c.dt, c.tm, c.cfg.num_hidden_layers
  p = _layer_params(c.params, 0)["ffn"]
  _, weights, experts = moe.route(p["router"], flat, cfg)
  mlp = None if tm is None else c.mods["mlp"]
  c.add("MoE block", layers, c.pair(lambda p, h: moe.forward(p, h, cfg)[0], (p, c.x), (0, 1)),
        None if tm is None else c.torch_pair(mlp, (c.tx,), mlp))
  c.add("  routing (router, top-k)", layers,
        c.pair(lambda w, h: moe.route(w, h, cfg)[1], (p["router"], flat), (0, 1)),
        None if tm is None else c.torch_pair(lambda h: mlp.gate(h)[1], (c.tflat,), mlp.gate))
  c.add("  routed experts", layers,
        c.pair(lambda p, h, w: moe.routed_experts(p, h, w, experts, cfg), (p, flat, weights),
               (0, 1, 2)),
        None if tm is None else c.torch_pair(
            lambda h, w: mlp.experts(h, c.torch.from_numpy(np.array(experts)).long(), w),
            (c.tflat, c.torch.from_numpy(np.array(weights)).to(tm.dtype).requires_grad_(True)),
            mlp.experts))
  _add_moe_dispatch(c, p, experts, weights)
  if cfg.shared_expert_intermediate_size:
    def shared(p, h):
      s = moe.swiglu(p, h, dt, prefix="shared_")
      return jax.nn.sigmoid(common.dense(h, p["shared_expert_gate"][:, None], dt)) * s
    shared_p = {k: v for k, v in p.items() if k.startswith("shared_")}
    c.add("  shared expert", layers, c.pair(shared, (shared_p, flat), (0, 1)),
          None if tm is None else c.torch_pair(
              lambda h: c.torch.sigmoid(mlp.shared_expert_gate(h)) * mlp.shared_expert(h),
              (c.tflat,), mlp))


def _add_moe_dispatch(c: _Inputs, p, experts, weights) -> None:
  """The routed experts in three parts, as the model dispatches them (`model.moe_dispatch`);
  the reference loops over experts, gathering, multiplying and adding back in one loop, so
  these rows have no counterpart."""
  cfg, flat, dt, layers = c.cfg, c.flat, c.dt, c.cfg.num_hidden_layers
  routed_p = {k: p[k] for k in ("wi_gate", "wi_up", "wo")}
  if moe.dispatch_of(cfg) == "blocked":
    xs, (pos, _, _, block_expert, _) = moe.blocked_dispatch(flat, experts, cfg)
    c.add("    dispatch (layout, gather)", layers,
          c.pair(lambda h: moe.blocked_dispatch(h, experts, cfg)[0], (flat,), (0,)), None)
    c.add("    expert matmuls (blocked)", layers,
          c.pair(lambda p, xs: moe.blocked_expert_mlp(p, xs, block_expert, cfg),
                 (routed_p, xs), (0, 1)), None)
    ys = moe.blocked_expert_mlp(routed_p, xs, block_expert, cfg)
    c.add("    combine (gather, weight)", layers,
          c.pair(lambda ys, w: moe.blocked_combine(ys, pos, w), (ys, weights), (0, 1)), None)
  else:
    xs, (order, sizes) = moe.ragged_dispatch(flat, experts, cfg)
    c.add("    dispatch (sort, gather)", layers,
          c.pair(lambda h: moe.ragged_dispatch(h, experts, cfg)[0], (flat,), (0,)), None)
    c.add("    expert matmuls (ragged_dot)", layers,
          c.pair(lambda p, xs: moe.ragged_expert_mlp(p, xs, sizes, dt), (routed_p, xs),
                 (0, 1)), None)
    ys = moe.ragged_expert_mlp(routed_p, xs, sizes, dt)
    c.add("    combine (weight, scatter-add)", layers,
          c.pair(lambda ys, w: moe.ragged_combine(ys, order, w), (ys, weights), (0, 1)), None)


def _time_ms(f, rounds_times, reps=1):
  t0 = time.perf_counter()
  for _ in range(reps):
    f()
  rounds_times.append((time.perf_counter() - t0) * 1e3 / reps)


def _reps(f, target_s=0.02, most=50):
  """Calls of f per timed round: enough for ~target_s, so short components are not all noise."""
  t0 = time.perf_counter()
  f()
  return max(1, min(most, int(target_s / max(time.perf_counter() - t0, 1e-6))))


def run_breakdown(args, cfg, params, tokens, jax_step, torch_model, torch_step):
  """Times every component (forward, forward+backward) of JAX and torch in alternating rounds;
  returns rows {name, layers, jax_fwd_ms, jax_bwd_ms, torch_fwd_ms, torch_bwd_ms} (backward =
  forward+backward minus forward; torch None where it has no separate counterpart) and the
  whole step's figures."""
  comps = breakdown_components(args, cfg, params, tokens, torch_model)
  names = list(comps)
  times = {(nm, side, kind): [] for nm in names for side in ("jax", "torch") for kind in (0, 1)}
  step_times = {"jax": [], "torch": []}
  for nm, (count, jp, tp) in list(comps.items()):
    for f in jp:
      f()   # compile / warm up every function once
    try:
      for f in tp or ():
        f()
    except RuntimeError as e:   # a reference function autograd cannot differentiate as called
      print(f"breakdown: no torch figure for {nm.strip()!r}: {str(e).splitlines()[0][:120]}")
      comps[nm] = (count, jp, None)
  jax_step()
  if torch_step:
    torch_step()
  reps = {(nm, side, kind): _reps(pair[kind]) for nm in names
          for side, pair in (("jax", comps[nm][1]), ("torch", comps[nm][2])) if pair
          for kind in (0, 1)}
  # A round times every JAX function, then every torch one: right after torch's calls its
  # OpenMP threads still spin for a while and would be billed to a JAX call timed next (the
  # pause lets them go idle first).
  for _ in range(args.breakdown_rounds):
    time.sleep(0.2)
    _time_ms(jax_step, step_times["jax"])
    for nm in names:
      for kind in (0, 1):
        _time_ms(comps[nm][1][kind], times[(nm, "jax", kind)], reps[(nm, "jax", kind)])
    if torch_step:
      _time_ms(torch_step, step_times["torch"])
    for nm in names:
      tp = comps[nm][2]
      for kind in (0, 1):
        if tp:
          _time_ms(tp[kind], times[(nm, "torch", kind)], reps[(nm, "torch", kind)])
  med = lambda xs: float(np.median(xs)) if xs else None
  rows = []
  for nm in names:
    r = {"name": nm, "layers": comps[nm][0]}
    for side in ("jax", "torch"):
      f, fb = med(times[(nm, side, 0)]), med(times[(nm, side, 1)])
      r[f"{side}_fwd_ms"] = f
      r[f"{side}_bwd_ms"] = None if f is None else max(fb - f, 0.0)
    rows.append(r)
  step = {side: med(v) for side, v in step_times.items()}
  return rows, step


# Components that are parts of another row (indented in the table): not added to the sum.
def _top_level(name: str) -> bool:
  return not name.startswith(" ")


def print_breakdown(rows, step):
  """Prints the table (per-call ms and x layers totals) and returns its JSON form."""
  def fmt(v):
    return f"{v:9.2f}" if v is not None else f"{'-':>9}"

  def ratio(j, t):
    return f"{t / j:6.2f}x" if (j and t) else f"{'-':>7}"
  print("\nbreakdown (ms per call, median of alternating rounds; bwd = fwd+bwd - fwd; "
        "ratio = torch / jax, > 1: jax faster)")
  print(f"{'component':34s} {'x':>3} {'jax fwd':>9} {'torch fwd':>9} {'ratio':>7} "
        f"{'jax bwd':>9} {'torch bwd':>9} {'ratio':>7}")
  total = {"jax": 0.0, "torch": 0.0}
  for r in rows:
    print(f"{r['name']:34s} {r['layers']:>3} {fmt(r['jax_fwd_ms'])} {fmt(r['torch_fwd_ms'])} "
          f"{ratio(r['jax_fwd_ms'], r['torch_fwd_ms'])} {fmt(r['jax_bwd_ms'])} "
          f"{fmt(r['torch_bwd_ms'])} {ratio(r['jax_bwd_ms'], r['torch_bwd_ms'])}")
    if _top_level(r["name"]):
      for side in total:
        f, b = r[f"{side}_fwd_ms"], r[f"{side}_bwd_ms"]
        if f is not None:
          total[side] += r["layers"] * (f + b)
  out = {"rows": rows, "sum_of_parts_ms": {}, "step_ms": step, "scan_overhead_ms": {}}
  for side in total:
    if step.get(side) is not None:
      out["sum_of_parts_ms"][side] = total[side]
      out["scan_overhead_ms"][side] = step[side] - total[side]
  j, t = out["sum_of_parts_ms"].get("jax"), out["sum_of_parts_ms"].get("torch")
  print(f"{'sum of parts x layers (fwd+bwd)':38s} {fmt(j)} {fmt(t)} {ratio(j, t)}")
  j, t = step.get("jax"), step.get("torch")
  print(f"{'whole step (fwd+bwd)':38s} {fmt(j)} {fmt(t)} {ratio(j, t)}")
  j, t = out["scan_overhead_ms"].get("jax"), out["scan_overhead_ms"].get("torch")
  print(f"{'step - sum of parts (scan, glue)':38s} {fmt(j)} {fmt(t)}")
  return out


def _gib(n) -> str:
  return "n/a (no allocator statistics)" if n is None else f"{n / 2**30:.2f} GiB"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--hidden", type=int, default=128)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--head_dim", type=int, default=32)
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--topk", type=int, default=2)
  ap.add_argument("--moe_ffn", type=int, default=128)
  ap.add_argument("--vocab", type=int, default=1024)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--rounds", type=int, default=7,
                  help="alternating rounds of --iters steps each side for the ratio (medians)")
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--no_torch", action="store_true")
  ap.add_argument("--compile_layers", default="8,40",
                  help="layer counts whose compile time is measured; '' = none")
  ap.add_argument("--set", action="append", default=[],
                  help="model config override key=value (repeatable), e.g. model.remat=full")
  ap.add_argument("--breakdown", action="store_true",
                  help="also time each component beside transformers' modules")
  ap.add_argument("--breakdown_rounds", type=int, default=5, help="alternating rounds (median)")
  ap.add_argument("--torch_threads", type=int, default=0, help="0 = torch's default")
  ap.add_argument("--xla_cpu_dots", default=base.get_config().train.xla_cpu_dots,
                  choices=xla_flags.CPU_DOTS,
                  help="XLA:CPU's matmul library for the step, as the train step compiles it "
                       "(train.xla_cpu_dots, models/xla_flags.py)")
  args = ap.parse_args()
  print(f"devices: {jax.devices()}; step dots: {args.xla_cpu_dots}")

  cfg = _cfg(args, args.layers)
  tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq), 0, cfg.vocab_size)
  n_tok = args.batch * args.seq
  jax_s, _, params, jax_step = jax_step_time(cfg, tokens, args.iters, args.xla_cpu_dots,
                                             return_step=True)
  counts = qwen3_5.count_params(cfg)
  out = {"tokens_per_step": n_tok, "jax_tokens_per_s": n_tok / jax_s, "xla_cpu_dots": args.xla_cpu_dots,
         "params": counts["total"], "active_params": counts["active"], "dtype": args.dtype,
         "config": {k: getattr(args, k) for k in ("hidden", "heads", "head_dim", "experts",
                                                   "topk", "moe_ffn", "vocab", "layers",
                                                   "batch", "seq")}}
  print(f"model: {counts['total'] / 1e6:.2f} M params ({counts['active'] / 1e6:.2f} M active), "
        f"{args.dtype}, batch {args.batch} x {args.seq} tokens")
  print(f"jax   fwd+bwd: {n_tok / jax_s:10.0f} tokens/s ({jax_s * 1e3:.1f} ms/step)")
  torch_model = torch_step = None
  if not args.no_torch:
    if args.torch_threads:
      import torch  # lazy: the reference only (test dependencies), and heavy
      torch.set_num_threads(args.torch_threads)
    torch_s, torch_model, torch_step = torch_step_time(cfg, params, tokens, args.iters,
                                                       return_model=True)
    print(f"torch fwd+bwd: {n_tok / torch_s:10.0f} tokens/s ({torch_s * 1e3:.1f} ms/step)")
    print(f"ratio jax/transformers, one after the other: {torch_s / jax_s:.2f}x")
    side = side_by_side(jax_step, torch_step, args.rounds, args.iters)
    jax_s, torch_s = side["jax_ms"] / 1e3, side["torch_ms"] / 1e3
    out["jax_tokens_per_s"] = n_tok / jax_s
    out["torch_tokens_per_s"] = n_tok / torch_s
    out["speedup_vs_transformers"] = side["ratio"]
    out["speedup_range"] = side["ratio_range"]
    out["rounds"] = args.rounds
    lo, hi = side["ratio_range"]
    print(f"alternating rounds ({args.rounds} x {args.iters} steps each side, medians): jax "
          f"{n_tok / jax_s:.0f} tokens/s ({jax_s * 1e3:.1f} ms), torch {n_tok / torch_s:.0f} "
          f"tokens/s ({torch_s * 1e3:.1f} ms)")
    print(f"ratio jax/transformers: {side['ratio']:.2f}x (rounds {lo:.2f}x - {hi:.2f}x)")
  if args.breakdown:
    rows, step = run_breakdown(args, cfg, params, tokens, jax_step, torch_model, torch_step)
    out["breakdown"] = print_breakdown(rows, step)
  compile_times = {}
  for layers in [int(x) for x in args.compile_layers.split(",") if x]:
    c = _cfg(args, layers)
    small = jax.random.randint(jax.random.key(2), (2, 128), 0, c.vocab_size)
    _, compile_s, _ = jax_step_time(c, small, 1, args.xla_cpu_dots)
    compile_times[layers] = compile_s
    print(f"compile fwd+bwd, {layers:3d} layers: {compile_s:.1f}s")
  out["compile_s"] = compile_times
  if compile_times:
    lo, hi = min(compile_times), max(compile_times)
    out["compile_ratio"] = compile_times[hi] / compile_times[lo]
    print(f"compile ratio {hi}/{lo} layers: {out['compile_ratio']:.2f}x")
  out["peak_bytes_in_use"] = device_memory.peak_bytes_in_use()   # the whole run's; CPU: None
  print(f"peak device memory: {_gib(out['peak_bytes_in_use'])}")
  print(json.dumps(out))


if __name__ == "__main__":
  main()
