"""The train step with the tiny model: micro-batching, sharding, learning, checkpoints.

Compiles are the cost here (8 fake devices on a small CPU), so each TrainStep is built once
per module and reused.
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import sharding
from models import xla_flags
from rl import checkpoint as ckpt_lib
from rl import reductions
from rl import train_step
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_utils  # noqa: E402


def _single_device_mesh(config):
  with config.mesh.unlocked():
    config.mesh.shape = (1, 1, 1, 1)
  return sharding.make_mesh(config.mesh, devices=jax.devices()[:1])


def _mesh(config, shape):
  with config.mesh.unlocked():
    config.mesh.shape = shape
  return sharding.make_mesh(config.mesh)


_CACHE = {}


def _step(name, shape=None, **overrides):
  """A cached TrainStep; shape None = one device."""
  key = (name, shape, tuple(sorted(overrides.items())))
  if key not in _CACHE:
    c = train_utils.small_config(**overrides)
    mesh = _single_device_mesh(c) if shape is None else _mesh(c, shape)
    _CACHE[key] = train_step.TrainStep(c, mesh, return_grads=True)
  return _CACHE[key]


@pytest.fixture(scope="module")
def base_state_and_batch():
  step = _step("single")
  state = step.init_state(jax.random.key(0))
  host_state = jax.device_get(state)
  batch = train_utils.make_batch(step.config, state["params"], seed=1)
  return host_state, batch


def _put_state(step, host_state):
  return jax.device_put(host_state, step.state_shardings)


def _rel_close(a, b, rtol=1e-5, what=""):
  """|a - b| <= rtol * max(|b|) per leaf (relative to the leaf's scale)."""
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    scale = max(np.abs(y).max(), 1e-30)
    err = np.abs(x - y).max() / scale
    assert err <= rtol, f"{what}{jax.tree_util.keystr(path)}: rel err {err:.2e} > {rtol}"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU option")
@pytest.mark.parametrize("dots", xla_flags.CPU_DOTS)
def test_the_step_compiles_its_dots_in_the_library_the_config_names(base_state_and_batch, dots):
  step = _step("single", **{"train.xla_cpu_dots": dots})
  host_state, batch = base_state_and_batch
  hlo = step.lower(_put_state(step, host_state), batch).compile().as_text()
  assert (xla_flags.ynnpack_dots(hlo) > 0) == (dots == "ynnpack")


@pytest.mark.slow
def test_micro_batches_match_with_model(base_state_and_batch):
  host_state, batch = base_state_and_batch
  outs = {}
  for n in (1, 4):
    step = _step("single", **{"train.micro_batches": n}) if n > 1 else _step("single")
    state, m = step(_put_state(step, host_state), step.shard_batch(batch))
    outs[n] = (jax.device_get(m), jax.device_get(state["params"]))
  m1, p1 = outs[1]
  m4, p4 = outs[4]
  np.testing.assert_allclose(m4["loss/total"], m1["loss/total"], rtol=1e-5)
  _rel_close(m4["grads"], m1["grads"], what="grads ")
  _rel_close(p4, p1, what="params ")
  for k in ("policy/clip_frac", "policy/approx_kl", "policy/entropy"):
    np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 2, 2, 1), (2, 1, 1, 4)], ids=["data2_fsdp2_expert2", "data2_tensor4"])
def test_sharded_step_matches_single_device(base_state_and_batch, shape):
  host_state, batch = base_state_and_batch
  ref = _step("single")
  ref_state, ref_m = ref(_put_state(ref, host_state), ref.shard_batch(batch))
  ref_m, ref_p = jax.device_get(ref_m), jax.device_get(ref_state["params"])

  step = _step("sharded", shape)
  state = _put_state(step, host_state)
  # Params really are sharded as the rules say.
  wi = state["params"]["blocks"][0]["ffn"]["wi_gate"]
  mesh_shape = dict(step.mesh.shape)
  expected = tuple(a for a in ("expert", "fsdp", "tensor") if mesh_shape[a] > 1)
  used = [a for entry in wi.sharding.spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
  assert set(used) == set(expected), (wi.sharding.spec, expected)
  n_shards = len({idx for idx in (tuple((s.start, s.stop) for s in sh.index) for sh in wi.addressable_shards)})
  assert n_shards == np.prod([mesh_shape[a] for a in expected])
  sharded_batch = step.shard_batch(batch)
  assert sharded_batch["tokens"].sharding.spec[0] is not None

  new_state, m = step(state, sharded_batch)
  for leaf in jax.tree.leaves(new_state["params"]):      # out shardings are the state's
    assert leaf.sharding.mesh.shape == step.mesh.shape
  m, p = jax.device_get(m), jax.device_get(new_state["params"])
  np.testing.assert_allclose(m["loss/total"], ref_m["loss/total"], rtol=1e-5)
  np.testing.assert_allclose(m["optim/grad_norm"], ref_m["optim/grad_norm"], rtol=1e-5)
  _rel_close(m["grads"], ref_m["grads"], what="grads ")
  _rel_close(p, ref_p, what="params ")
  # Opt state sharded like the params.
  mu = new_state["opt_state"][1][0].mu["blocks"][0]["ffn"]["wi_gate"]
  assert mu.sharding.spec == wi.sharding.spec


def test_step_with_filtered_groups_packed_and_skipped_matches_one_micro_batch(base_state_and_batch):
  """A zero-variance group, its rows packed into the last micro-batch (rl.batch.build_batch) which
  the step then skips: same loss, metrics and update as the whole batch in one micro-batch."""
  host_state, batch = base_state_and_batch
  batch = {k: np.array(v) for k, v in batch.items()}
  first = batch["group_ids"] == batch["group_ids"][0]
  batch["rewards"][first] = 1.0                           # group 0: all pass, no signal
  live = reductions.live_rows(batch["rewards"], batch["group_ids"], np.ones(len(first), bool),
                        batch["loss_mask"], True)
  assert live.tolist() == (~first).tolist()
  outs = {}
  for n in (1, 2):
    step = _step("single", **{"train.micro_batches": n}) if n > 1 else _step("single")
    b = reductions.pack_live_rows(batch, live, n)
    state, m = step(_put_state(step, host_state), step.shard_batch(b))
    outs[n] = (jax.device_get(m), jax.device_get(state["params"]))
  (m1, p1), (m2, p2) = outs[1], outs[2]
  np.testing.assert_allclose(m2["loss/total"], m1["loss/total"], rtol=1e-5)
  np.testing.assert_allclose(m2["policy/entropy"], m1["policy/entropy"], rtol=1e-5)
  _rel_close(p2, p1, what="params ")


def test_recomputed_old_logprobs_are_the_current_params_logprobs_in_row_order(
    base_state_and_batch):
  """rl.recompute_old_logprobs: old logprobs come from this step's params (computed per
  micro-batch, reassembled in the batch's row order), not from the engine's report."""
  host_state, batch = base_state_and_batch
  step = _step("single", **{"rl.recompute_old_logprobs": True, "train.micro_batches": 2})
  batch = dict(batch, rollout_logprobs=np.full_like(batch["rollout_logprobs"], -5.0))
  params = _put_state(step, host_state)["params"]
  with sharding.use_mesh(step.mesh, step.rules):
    prepared, _ = jax.jit(step.prepare)(params, step.shard_batch(batch))
    want, _ = jax.jit(lambda p, t: train_step.token_logprobs(step.model_cfg, p, t,
                                                             step.config.rl.temperature))(
        params, jnp.asarray(batch["tokens"]))
  got, want = np.asarray(prepared["old_logprobs"]), np.asarray(want)
  assert np.abs(got - want).max() < 1e-4
  # Row order matters: the per-micro-batch pieces must not come back permuted.
  assert np.abs(got - want[::-1]).max() > 1e-2
  np.testing.assert_array_equal(np.asarray(prepared["rollout_logprobs"]), -5.0)


def test_step_learns_on_fixed_batch(base_state_and_batch):
  host_state, batch = base_state_and_batch
  step = _step("single")
  state = _put_state(step, host_state)
  b = step.shard_batch(batch)
  losses = []
  for _ in range(5):
    state, m = step(state, b)
    losses.append(float(m["loss/total"]))
  assert losses[-1] < losses[0] - 1e-3, losses
  assert int(state["step"]) == 5


@pytest.mark.parametrize("skip", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_step_without_signal_leaves_params_and_optimizer_state_alone(base_state_and_batch, skip):
  """A batch whose groups all have equal rewards (all filtered) after a learning step: with
  train.skip_empty_updates the params and AdamW state stay as they were; without it AdamW's
  momentum still moves the params (what the skip prevents)."""
  host_state, batch = base_state_and_batch
  # skip_empty_updates is on by default: the default step is the cached, compiled one.
  step = _step("single") if skip else _step("single", **{"train.skip_empty_updates": False})
  state, _ = step(_put_state(step, host_state), step.shard_batch(batch))
  before = jax.device_get({"params": state["params"], "opt_state": state["opt_state"]})
  empty = dict(batch, rewards=np.ones_like(batch["rewards"]))
  state, m = step(state, step.shard_batch(empty))
  after = jax.device_get({"params": state["params"], "opt_state": state["opt_state"]})
  assert int(state["step"]) == 2
  assert float(m["tokens/loss_tokens"]) == 0.0
  moved = max(float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
              for a, b in zip(jax.tree.leaves(after["params"]), jax.tree.leaves(before["params"])))
  if skip:
    assert moved == 0.0
    assert float(m["optim/update_norm"]) == 0.0
    for a, b in zip(jax.tree.leaves(after["opt_state"]), jax.tree.leaves(before["opt_state"])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  else:
    assert moved > 1e-5


def test_kill_and_restore_reproduces_next_step(base_state_and_batch, tmp_path):
  host_state, batch = base_state_and_batch
  step = _step("single")
  b = step.shard_batch(batch)
  ck = ckpt_lib.Checkpointer(str(tmp_path / "ck"), save_every=2, keep=2, async_save=True)
  state = _put_state(step, host_state)
  for i in range(1, 4):
    state, _ = step(state, b)
    ck.maybe_save(i, state, {"data_position": 10 * i})
  uninterrupted, _ = step(state, b)             # step 4 without interruption
  want = jax.device_get(uninterrupted)
  ck.close()
  del state, uninterrupted                     # the "killed" run leaves nothing behind

  ck2 = ckpt_lib.Checkpointer(str(tmp_path / "ck"), save_every=2, keep=2, async_save=True)
  restored = ck2.restore_latest(step.abstract_state())
  assert restored is not None
  at, state, meta = restored
  assert at == 2 and meta["data_position"] == 20 and int(state["step"]) == 2
  state, _ = step(state, b)                    # replay step 3
  state, _ = step(state, b)                    # step 4
  got = jax.device_get(state)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  ck2.close()


def test_corrupt_checkpoint_falls_back(base_state_and_batch, tmp_path):
  host_state, _ = base_state_and_batch
  step = _step("single")
  ck = ckpt_lib.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=3, async_save=False)
  state = _put_state(step, host_state)
  ck.save(1, state, {"data_position": 1})
  ck.save(2, state, {"data_position": 2})
  ck.wait()
  state_dir = tmp_path / "ck" / "2" / "state"
  assert state_dir.exists()
  for root, _, files in os.walk(state_dir):
    for f in files:
      os.remove(os.path.join(root, f))
  restored = ck.restore_latest(step.abstract_state())
  assert restored is not None and restored[0] == 1 and restored[2]["data_position"] == 1
  assert [s for s, _ in ck.skipped] == [2]
  ck.close()


def test_optimizer_schedule():
  c = train_utils.small_config(**{"optim.warmup_steps": 4, "optim.schedule": "cosine",
                                  "optim.lr": 1.0, "optim.min_lr_ratio": 0.1, "train.steps": 14})
  sched = train_step.make_schedule(c.optim, c.train.steps)
  np.testing.assert_allclose([float(sched(i)) for i in (0, 2, 4, 14)], [0.0, 0.5, 1.0, 0.1],
                             atol=1e-6)
  c = train_utils.small_config(**{"optim.schedule": "constant"})
  assert float(train_step.make_schedule(c.optim, 10)(7)) == c.optim.lr


def test_sgd_moves_each_weight_in_proportion_to_its_gradient_where_adamw_takes_a_sign_step():
  grads = {"w": jnp.array([1e-4, 1e-2, 1.0])}
  params = {"w": jnp.zeros(3)}
  moved = {}
  for name in ("adamw", "sgd"):
    c = train_utils.small_config(**{"optim.name": name, "optim.lr": 0.1, "optim.grad_clip": 0.0,
                           "optim.eps": 1e-8, "optim.weight_decay": 0.0})
    tx = train_step.make_optimizer(c.optim, 10)
    updates, _ = tx.update(grads, tx.init(params), params)
    moved[name] = np.asarray(updates["w"])
  np.testing.assert_allclose(moved["adamw"], [-0.1, -0.1, -0.1], rtol=1e-3)
  np.testing.assert_allclose(moved["sgd"], [-1e-5, -1e-3, -0.1], rtol=1e-5)
  c = train_utils.small_config(**{"optim.name": "lion"})
  with pytest.raises(ValueError, match="unknown optim.name 'lion'"):
    train_step.make_optimizer(c.optim, 10)


def test_trainable_pattern_updates_only_matching_params_and_clips_over_them(base_state_and_batch):
  """optim.trainable: matching leaves move exactly as an optimizer over them alone would (so
  clipping and weight decay ignore the frozen ones); the rest get a zero update."""
  host_state, _ = base_state_and_batch
  params = host_state["params"]
  grads = jax.tree_util.tree_map(lambda p: jnp.full(p.shape, 3.0, jnp.float32), params)
  c = train_utils.small_config(**{"optim.trainable": r"norm$", "optim.lr": 0.1,
                                  "optim.grad_clip": 1.0})
  tx = train_step.make_optimizer(c.optim, 10)
  opt_state = tx.init(params)
  updates, _ = tx.update(grads, opt_state, params)
  labels = jax.tree_util.tree_map(lambda m: "train" if m else "frozen",
                                  train_step.trainable_mask(r"norm$", params))
  moved = frozen = 0
  for (path, u), label in zip(jax.tree_util.tree_leaves_with_path(updates),
                              jax.tree_util.tree_leaves(labels)):
    name = train_step.param_path(path)
    assert (label == "train") == name.endswith("norm"), name
    if label == "train":
      moved += 1
      assert np.all(np.asarray(u) != 0), name
    else:
      frozen += 1
      assert np.all(np.asarray(u) == 0), name
  assert moved and frozen
  # Same update as the plain optimizer on the trainable leaves alone.
  only = {k: v for k, v in enumerate(
      l for l, lab in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(labels))
      if lab == "train")}
  c_all = train_utils.small_config(**{"optim.lr": 0.1, "optim.grad_clip": 1.0})
  plain = train_step.make_optimizer(c_all.optim, 10)
  g_only = jax.tree_util.tree_map(lambda p: jnp.full(p.shape, 3.0, jnp.float32), only)
  ref, _ = plain.update(g_only, plain.init(only), only)
  got = [u for u, lab in zip(jax.tree_util.tree_leaves(updates), jax.tree_util.tree_leaves(labels))
         if lab == "train"]
  for a, b in zip(got, jax.tree_util.tree_leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  for bad, match in (("no_such_param", "matches no parameter"),
                     ("final_norm(", "not a regular expression")):
    c = train_utils.small_config(**{"optim.trainable": bad})
    with pytest.raises(ValueError, match=match):
      train_step.make_optimizer(c.optim, 10).init(params)


def test_micro_batches_of_fewer_rows_than_devices_run_whole_and_match_one_device(
    base_state_and_batch):
  """train.micro_batches=4 on 8 rows split over 8 devices would give a micro-batch 2 rows for 8
  devices (XLA gathers and replicates each such micro-batch: the tiny default's step took 8x
  the time, docs/results.md). The step runs the 8 rows as one micro-batch, with one device's
  loss, gradients and update (one device's step is the same at 1 and 4 micro-batches:
  test_micro_batches_match_with_model; the base step here is compiled once for the module)."""
  host_state, batch = base_state_and_batch
  ref = _step("single")
  ref_state, ref_m = ref(_put_state(ref, host_state), ref.shard_batch(batch))
  ref_m, ref_p = jax.device_get(ref_m), jax.device_get(ref_state["params"])
  step = _step("sharded", (1, 8, 1, 1), **{"train.micro_batches": 4})
  assert step.micro_batches(8) == 1
  new_state, m = step(_put_state(step, host_state), step.shard_batch(batch))
  m, p = jax.device_get(m), jax.device_get(new_state["params"])
  np.testing.assert_allclose(m["loss/total"], ref_m["loss/total"], rtol=1e-5)
  _rel_close(m["grads"], ref_m["grads"], what="grads ")
  _rel_close(p, ref_p, what="params ")


def test_context_parallel_step_matches_single_device(base_state_and_batch):
  """Each row's tokens split over `fsdp` (sharding.context_parallel_rules), with the recipe's
  long-context settings (full remat, query-chunked attention, chunked logits): the same loss,
  gradients and update as one device computing whole rows."""
  host_state, batch = base_state_and_batch
  long_context = {"model.remat": "full", "model.attention_query_chunk": 8,
                  "model.logits_chunk": 8, "train.micro_batches": 4}
  ref = _step("single", **long_context)
  ref_state, ref_m = ref(_put_state(ref, host_state), ref.shard_batch(batch))
  ref_m, ref_p = jax.device_get(ref_m), jax.device_get(ref_state["params"])

  c = train_utils.small_config(**long_context)
  with c.mesh.unlocked():
    c.mesh.rules = sharding.context_parallel_rules(c.mesh.rules, "fsdp")
  step = train_step.TrainStep(c, _mesh(c, (1, 4, 2, 1)), return_grads=True)
  # 8 rows, 4 micro-batches: 2 rows a micro-batch, one per `expert` shard, each split 4 ways.
  assert dict(step.rules)["activation_length"] == "fsdp"
  assert dict(step.rules)["batch"] == ("data", "expert")
  new_state, m = step(_put_state(step, host_state), step.shard_batch(batch))
  m, p = jax.device_get(m), jax.device_get(new_state["params"])
  np.testing.assert_allclose(m["loss/total"], ref_m["loss/total"], rtol=1e-5)
  _rel_close(m["grads"], ref_m["grads"], what="grads ")
  _rel_close(p, ref_p, what="params ")


def test_a_batch_padded_to_a_shorter_bucket_trains_as_at_the_full_row_length(base_state_and_batch):
  """train.seq_buckets: the same trajectories padded to 16 instead of 24 give the same loss,
  gradients and update (padding after a row's end changes nothing, Dr. GRPO's constant is the
  configured row length); other row lengths are refused."""
  host_state, batch = base_state_and_batch
  step = _step("single", **{"train.seq_buckets": (16,), "rl.loss_reduction": "seq_mean_token_sum_norm"})
  short = train_utils.make_batch(train_utils.small_config(**{"train.seq_len": 16}), seed=3)
  full = {k: np.pad(v, ((0, 0), (0, 8))) if v.ndim == 2 else v for k, v in short.items()}
  outs = []
  for b in (full, short):
    state, m = step(_put_state(step, host_state), step.shard_batch(b))
    outs.append((jax.device_get(m), jax.device_get(state["params"])))
  (m24, p24), (m16, p16) = outs
  np.testing.assert_allclose(m16["loss/total"], m24["loss/total"], rtol=1e-5)
  _rel_close(m16["grads"], m24["grads"], what="grads ")
  _rel_close(p16, p24, what="params ")
  odd = {k: v[:, :12] if v.ndim == 2 else v for k, v in short.items()}
  with pytest.raises(ValueError, match="row lengths \\(16, 24\\)"):
    step(_put_state(step, host_state), step.shard_batch(odd))


def test_kl_penalty_keeps_the_start_as_reference_and_adds_its_term_to_the_loss(
    base_state_and_batch):
  """(k1 runs end to end in tests/test_e2e_rl_options.py; both estimators' maths in
  tests/rl/test_policy_losses.py.)"""
  host_state, batch = base_state_and_batch
  coef, estimator = 0.5, "k3"
  # token_mean: the loss and the metrics weigh tokens alike, so loss = pg + coef * kl exactly.
  step = _step("kl", **{"rl.kl.coef": coef, "rl.kl.estimator": estimator,
                        "rl.loss_reduction": "token_mean", "train.micro_batches": 2})
  state = jax.device_put(dict(host_state, ref_params=host_state["params"]), step.state_shardings)
  start = host_state["params"]
  state, m1 = step(state, step.shard_batch(batch))
  state, m2 = step(state, step.shard_batch(batch))
  m1, m2 = jax.device_get(m1), jax.device_get(m2)
  # The first step's policy is the reference: its KL is zero; the second's moved away from it.
  assert abs(float(m1["policy/kl_ref"])) < 1e-7
  assert abs(float(m2["policy/kl_ref"])) > 1e-6
  assert float(m2["policy/kl_ref"]) > 0   # k3 is non-negative
  for m in (m1, m2):
    np.testing.assert_allclose(float(m["loss/total"]),
                               float(m["policy/pg_loss"]) + coef * float(m["policy/kl_ref"]),
                               rtol=1e-5, atol=1e-7)
  # The reference stays where RL started while the params move.
  ref, now = jax.device_get(state["ref_params"]), jax.device_get(state["params"])
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(start)):
    np.testing.assert_array_equal(a, b)
  assert any(np.abs(a - b).max() > 0 for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(start)))


def test_kl_reference_logprobs_are_the_start_params_logprobs(base_state_and_batch):
  host_state, batch = base_state_and_batch
  step = _step("kl", **{"rl.kl.coef": 0.5, "rl.kl.estimator": "k3",
                        "rl.loss_reduction": "token_mean", "train.micro_batches": 2})
  params = jax.device_put(host_state["params"], step.state_shardings["params"])
  b = step.shard_batch(batch)
  with sharding.use_mesh(step.mesh, step.rules):
    got = jax.jit(lambda p, t, m: step.batch_logprobs(p, t, m))(
        params, b["tokens"], b["loss_mask"])
    want = jax.jit(lambda p, t: train_step.token_logprobs(step.model_cfg, p, t, 1.0)[0])(
        params, b["tokens"])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _leaf_dtypes(tree) -> list:
  """(path, dtype) of every leaf of `tree`."""
  return [(jax.tree_util.keystr(p), x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def test_bfloat16_params_train_two_steps_and_a_skipped_one_keeping_every_leafs_dtype():
  """model.param_dtype=bfloat16 (what the GPU benchmark runs): the optimizer's float32 updates
  are rounded into the bfloat16 params, AdamW's moments keep their dtypes (mu in
  optim.mu_dtype), so the update and skip branches of the step agree; the loss stays finite
  and the params move. A batch with no signal then takes the skip branch, dtypes unchanged."""
  step = _step("bf16", **{"model.param_dtype": "bfloat16", "model.dtype": "bfloat16"})
  state = step.init_state(jax.random.key(0))
  start = jax.device_get(state["params"])   # the state is donated to the step
  assert {d for _, d in _leaf_dtypes(start)} == {jnp.dtype(jnp.bfloat16)}
  dtypes = _leaf_dtypes({"params": state["params"], "opt_state": state["opt_state"]})
  host = train_utils.make_batch(step.config, seed=1)
  for batch in (host, host, dict(host, rewards=np.ones_like(host["rewards"]))):
    state, m = step(state, step.shard_batch(batch))
    assert np.isfinite(float(m["loss/total"]))
    assert _leaf_dtypes({"params": state["params"], "opt_state": state["opt_state"]}) == dtypes
  assert int(state["step"]) == 3 and float(m["tokens/loss_tokens"]) == 0.0
  now = jax.device_get(state["params"])
  moved = [bool((np.asarray(a, np.float32) != np.asarray(b, np.float32)).any())
           for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(start))]
  assert sum(moved) > len(moved) / 2, moved
