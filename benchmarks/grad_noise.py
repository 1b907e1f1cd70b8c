"""Gradient noise scale of the GRPO step at `make run`'s start: how many informative groups a
step needs before its gradient points where the expected gradient points.

    python benchmarks/grad_noise.py                     # 64 train prompts x 4 samples, T 0.6
    python benchmarks/grad_noise.py --prompts=96 --set=loop.families=docx_lookup,pdf_lookup
    python benchmarks/grad_noise.py --sft_dir=runs/tiny_cpu/sft   # from make run's SFT params
    python benchmarks/grad_noise.py --task_pool=8             # 64 prompts from 8 tasks, 8 each

Rolls out `--prompts` level-1 train tasks x `train.samples_per_prompt` samples through the real
server and agent pool (the weights: `--sft_dir`'s newest save, else config.train.init_from),
builds the train step's batch (group masking, zero-variance filter), and takes the gradient
of the step's loss (config.rl: prompt_mean, DPPO binary-TV) one informative group at a time,
with the whole batch's reduction weights, so the group gradients g_1..g_n sum to the batch
gradient. Then, treating the groups as independent draws (McCandlish et al. 2018, "An
empirical model of large-batch training"):

  S       = sum_i |g_i - mean g|^2 / (n - 1)         trace of the per-group gradient covariance
  |G|^2   = |mean g|^2 - S / n                       unbiased squared norm of the expected gradient
  B_noise = S / |G|^2                                the noise scale, in informative groups

A step of k informative groups has signal-to-noise |G|^2 / (S / k) = k / B_noise. Also prints
the cosine between the mean gradients of two disjoint random halves of the groups (averaged
over splits), which is ~0 when noise dominates. Gradients are plain (before Adam). Asserts
nothing.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import bench_overrides  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])

import jax  # noqa: E402
from configs import tiny_cpu  # noqa: E402
from envs import worlds  # noqa: E402
from envs.harness.jetstream_client import jetstream_policy_factory  # noqa: E402
from envs.harness.pool import AgentPool  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from models import sharding  # noqa: E402
from rl import batch  # noqa: E402
from rl import metrics  # noqa: E402
from rl import params_io  # noqa: E402
from rl.rollout import draw  # noqa: E402
from rl import task_data  # noqa: E402
from rl.rollout.serve import build_server  # noqa: E402
from rl.train_step import TrainStep  # noqa: E402


def _estimates(k: np.ndarray) -> tuple[float, float]:
  """(S, unbiased |G|^2) from the Gram matrix k = g g^T of n per-group gradients."""
  n = k.shape[0]
  mean_sq = float(k.sum()) / n ** 2
  s = (float(np.trace(k)) - n * mean_sq) / (n - 1)
  return s, mean_sq - s / n


def noise_scale(g: np.ndarray, splits: int = 200, resamples: int = 2000, seed: int = 0) -> dict:
  """g: [n, params] per-group gradients (any common scale). The estimates of the docstring, a
  bootstrap (over groups) upper 95% bound on |G|^2 and so a lower bound on B_noise, and the
  disjoint-halves cosine. Everything is a function of the [n, n] Gram matrix."""
  n = g.shape[0]
  k = g @ g.T
  s, g2 = _estimates(k)
  rng = np.random.default_rng(seed)
  boot = []
  for _ in range(resamples):
    # |G|^2 (unbiased) is the mean of k_ij over pairs i != j; a resample keeps the pairs of two
    # distinct original groups, so a group drawn twice is not paired with itself.
    idx = rng.integers(0, n, n)
    distinct = idx[:, None] != idx[None, :]
    if distinct.any():
      boot.append(float(k[np.ix_(idx, idx)][distinct].mean()))
  g2_hi = float(np.percentile(boot, 95))
  cos = []
  for _ in range(splits):
    perm = rng.permutation(n)
    a, b = perm[: n // 2], perm[n // 2: 2 * (n // 2)]
    ab, aa, bb = k[np.ix_(a, b)].sum(), k[np.ix_(a, a)].sum(), k[np.ix_(b, b)].sum()
    cos.append(float(ab / np.sqrt(aa * bb)))
  return {"n": n, "trace_cov": s, "g2_unbiased": g2, "g2_hi95": g2_hi,
          "b_noise": s / g2 if g2 > 0 else float("inf"),
          "b_noise_lo95": s / g2_hi if g2_hi > 0 else float("inf"),
          "half_cos": float(np.mean(cos)), "half_cos_sd": float(np.std(cos))}


def module_slices(params) -> dict:
  """module name -> index array into the raveled parameter vector (ravel_pytree's order):
  embed, final_norm, and per block its mixer (attention or Gated DeltaNet), ffn (MoE) and
  norms."""
  out: dict = {}
  start = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [getattr(k, "key", getattr(k, "idx", k)) for k in path]
    if keys[0] == "blocks":
      name = f"block{keys[1]}/{keys[2] if keys[2] in ('mixer', 'ffn') else 'norms'}"
    else:
      name = str(keys[0])
    out.setdefault(name, []).append(np.arange(start, start + leaf.size))
    start += leaf.size
  return {k: np.concatenate(v) for k, v in out.items()}


def per_group_grads(step_fn, params, arrays: dict) -> tuple[np.ndarray, list]:
  """[n_live, params] float64 gradients of the step's loss, one informative group each.
  `arrays`: the batch as the jitted step takes it (`TrainExample.as_arrays()`)."""
  with sharding.use_mesh(step_fn.mesh, step_fn.rules):
    prepared, _ = jax.jit(step_fn.prepare)(params, arrays)
    mini = step_fn.add_weights(prepared)
    grad_fn = jax.jit(lambda p, mb: step_fn.loss_and_grads(p, mb)[1])
    gids = np.asarray(mini["group_ids"])
    live_rows = np.asarray(mini["loss_mask"]).sum(1) > 0
    groups = sorted({int(x) for x in gids[live_rows]})
    out = []
    for gid in groups:
      rows = np.where(gids == gid)[0]
      sub = {k: v[rows] for k, v in mini.items()}
      grads = grad_fn(params, sub)
      out.append(np.asarray(ravel_pytree(grads)[0], np.float64))
  return np.stack(out), groups


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--prompts", type=int, default=64, help="train tasks rolled out")
  ap.add_argument("--task_pool", type=int, default=0,
                  help="draw the prompts (with repeats) from this many train tasks; 0 = all, no repeats")
  ap.add_argument("--sft_dir", default="", help="orbax params dir (params_io.save_params); '' = init_from")
  ap.add_argument("--set", action="append", default=[], help="key=value config override")
  ap.add_argument("--by_module", action="store_true",
                  help="also the estimates restricted to each module's parameters")
  ap.add_argument("--save", default="", help="write the per-group Gram matrix and group families (.npz)")
  args = ap.parse_args()

  metrics.quiet_logs()
  config = tiny_cpu.get_config()
  config.unlock()
  bench_overrides.apply(config, args.set)
  config.train.prompts_per_step = args.prompts
  config.train.micro_batches = 1
  worlds.ensure_worlds(config.envs)
  params = params_io.load_params(args.sft_dir, config) if args.sft_dir else params_io.init_params(config)
  if params is None:
    sys.exit(f"no params saved under {args.sft_dir}")
  tasks = task_data.select_tasks(config, "train", config.loop.levels, families=tuple(config.loop.families))
  rng = np.random.default_rng(config.seed)
  if args.task_pool:
    pool_tasks = [tasks[i] for i in rng.choice(len(tasks), args.task_pool, replace=False)]
    picked = [pool_tasks[i % args.task_pool] for i in range(args.prompts)]
  else:
    picked = [tasks[i] for i in rng.choice(len(tasks), args.prompts, replace=False)]

  server = build_server(config, params=params, port=0)
  cfg = config.copy_and_resolve_references()
  with cfg.unlocked():
    cfg.rollout.address = server.address
  t0 = time.monotonic()
  try:
    with AgentPool.from_config(cfg, jetstream_policy_factory(cfg)) as pool:
      eps = task_data.make_episodes(picked, cfg, int(cfg.train.samples_per_prompt), seed_offset=104729)
      results = draw.run_pool(pool, eps, cfg, "rollouts")
  finally:
    server.stop()
  t_roll = time.monotonic() - t0
  example, _ = batch.build_batch(results, cfg)
  step_fn = TrainStep(cfg, sharding.make_mesh(cfg.mesh))
  t0 = time.monotonic()
  g, groups = per_group_grads(step_fn, params, example.as_arrays())
  t_grad = time.monotonic() - t0
  families = [picked[gid].family for gid in groups]
  fam = {f: families.count(f) for f in dict.fromkeys(families)}
  rewards = np.array([r.reward for r in results])
  drawn = f" from {args.task_pool} tasks" if args.task_pool else ""
  print(f"\n{args.prompts} train prompts{drawn} x {cfg.train.samples_per_prompt} samples at temperature "
        f"{cfg.rl.temperature} ({t_roll:.0f} s of rollouts, {t_grad:.0f} s of gradients): "
        f"pass rate {rewards.mean():.3f}, {len(groups)} informative groups "
        f"({len(groups) / args.prompts:.3f} a prompt; by family {fam})")
  if len(groups) < 4:
    print("too few informative groups to estimate the noise scale")
    return
  r = noise_scale(g)
  if args.save:
    np.savez(args.save, gram=g @ g.T, families=families)
  per_prompt = len(groups) / args.prompts
  b = r["b_noise"]
  print(f"per-group gradient: trace of covariance {r['trace_cov']:.4g}, |expected gradient|^2 "
        f"(unbiased) {r['g2_unbiased']:.4g} (bootstrap upper 95% bound {r['g2_hi95']:.4g})")
  lo = r["b_noise_lo95"]
  print(f"noise scale B_noise = {b:.1f} informative groups (~{b / per_prompt:.0f} prompts a step "
        f"at this rate), at least {lo:.1f} (~{lo / per_prompt:.0f} prompts) at 95%; a step of "
        f"1 / 2 / 8 informative groups has signal-to-noise {1 / b:.3f} / {2 / b:.3f} / "
        f"{8 / b:.3f}, at most {1 / lo:.3f} / {2 / lo:.3f} / {8 / lo:.3f}")
  print(f"cosine of two disjoint halves' mean gradients ({r['n'] // 2} groups each): "
        f"{r['half_cos']:.3f} (sd {r['half_cos_sd']:.3f} over splits)")
  if args.by_module:
    # Where in the network the expected gradient lives: a module whose parameters carry
    # signal above their noise would show a small B_noise and a positive halves' cosine.
    print(f"\n{'module':<16} {'params':>7} {'tr(cov) share':>13} {'B_noise':>9} {'>= (95%)':>9} "
          f"{'halves cos':>11}")
    for name, idx in module_slices(params).items():
      m = noise_scale(g[:, idx], resamples=500, splits=100)
      print(f"{name:<16} {len(idx):>7} {m['trace_cov'] / r['trace_cov']:>13.3f} "
            f"{m['b_noise']:>9.1f} {m['b_noise_lo95']:>9.1f} {m['half_cos']:>11.3f}")


if __name__ == "__main__":
  main()
