"""The train step with LoRA: only adapters train over a frozen base, the KL reference is the
base, sharded equals one device, and an adapter checkpoint resumes exactly."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import qwen3_5
from models import sharding
from rl import checkpoint as ckpt_lib
from rl import train_step
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_utils  # noqa: E402

LORA = {"lora.rank": 4, "lora.alpha": 8.0}
_CACHE = {}


def _step(name, shape=(1, 1, 1, 1), **overrides):
  """A cached LoRA TrainStep over a seeded base; shape (1, 1, 1, 1) = one device."""
  key = (name, shape, tuple(sorted(overrides.items())))
  if key not in _CACHE:
    c = train_utils.small_config(**LORA, **overrides)
    with c.mesh.unlocked():
      c.mesh.shape = shape
    devices = jax.devices()[:int(np.prod(shape))]
    step = train_step.TrainStep(c, sharding.make_mesh(c.mesh, devices=devices),
                                return_grads=True)
    step.set_base(step.init_base(jax.random.key(0)))
    _CACHE[key] = step
  return _CACHE[key]


def _leaves_equal(a, b) -> bool:
  return all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_two_steps_move_only_the_adapters_over_a_frozen_bfloat16_base():
  step = _step("bf16", **{"model.param_dtype": "bfloat16"})
  base_before = jax.device_get(step.base)
  assert {x.dtype for x in jax.tree.leaves(base_before)} == {jnp.dtype(jnp.bfloat16)}
  state = step.init_state(jax.random.key(1))
  # The state holds adapters and their optimizer state only: float32 masters, and moments
  # shaped like the adapters (no leaf of the base's structure, no reference copy).
  assert set(state) == {"params", "opt_state", "step", "rng"}
  adapters0 = jax.device_get(state["params"])
  assert {x.dtype for x in jax.tree.leaves(adapters0)} == {jnp.dtype(jnp.float32)}
  adapter_shapes = sorted(x.shape for x in jax.tree.leaves(adapters0))
  mu = state["opt_state"][1][0].mu
  assert jax.tree.structure(mu) == jax.tree.structure(adapters0)
  assert sorted(x.shape for x in jax.tree.leaves(mu)) == adapter_shapes
  n_base = sum(x.size for x in jax.tree.leaves(base_before))
  n_opt = sum(x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim)
  assert n_opt == 2 * sum(x.size for x in jax.tree.leaves(adapters0)) < n_base
  batch = train_utils.make_batch(step.config, seed=1)
  for _ in range(2):
    state, m = step(state, step.shard_batch(batch))
    assert np.isfinite(float(m["loss/total"])) and float(m["optim/grad_norm"]) > 0
  # Gradients exist for the adapters alone.
  assert jax.tree.structure(m["grads"]) == jax.tree.structure(adapters0)
  after = jax.device_get(state["params"])
  moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after),
                                                    jax.tree.leaves(adapters0))]
  assert all(moved), moved                        # every A and B moved (B from zero)
  assert _leaves_equal(jax.device_get(step.base), base_before)   # the base did not


def test_kl_reference_is_the_base_with_adapters_off():
  """At init the adapted policy is the base: the first step's KL to the reference is zero;
  after an update it is not. No reference copy is kept in the state."""
  step = _step("kl", **{"rl.kl.coef": 0.5, "rl.kl.estimator": "k3",
                        "rl.loss_reduction": "token_mean", "train.micro_batches": 2})
  state = step.init_state(jax.random.key(1))
  assert "ref_params" not in state
  batch = step.shard_batch(train_utils.make_batch(step.config, seed=1))
  state, m1 = step(state, batch)
  state, m2 = step(state, batch)
  assert abs(float(m1["policy/kl_ref"])) < 1e-7
  assert float(m2["policy/kl_ref"]) > 1e-7
  for m in (m1, m2):
    np.testing.assert_allclose(float(m["loss/total"]),
                               float(m["policy/pg_loss"]) + 0.5 * float(m["policy/kl_ref"]),
                               rtol=1e-5, atol=1e-7)
  # And the reference logprobs are the base's.
  with sharding.use_mesh(step.mesh, step.rules):
    ref = jax.jit(lambda b, t, msk: step.batch_logprobs(b, t, msk))(
        step.base, batch["tokens"], batch["loss_mask"])
    want = jax.jit(lambda b, t: train_step.token_logprobs(step.model_cfg, b, t, 1.0)[0])(
        step.base, batch["tokens"])
  mask = np.asarray(batch["loss_mask"]) > 0
  np.testing.assert_allclose(np.asarray(ref)[mask], np.asarray(want)[mask], rtol=1e-5, atol=1e-6)


def _rel_close(a, b, rtol, what):
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    err = np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)
    assert err <= rtol, f"{what}{jax.tree_util.keystr(path)}: rel err {err:.2e} > {rtol}"


@pytest.mark.slow
def test_sharded_and_micro_batched_lora_step_matches_one_device():
  """FSDP, expert and tensor parallel (2 x 2 x 2) with 2 micro-batches against one device and
  one micro-batch: same loss, adapter gradients and updated adapters; the routed experts'
  adapters are split over the expert axis like the experts. (The batch's rows are split over
  fsdp x expert: 4 rows a micro-batch, one a device.)"""
  ref = _step("single")
  host_state = jax.device_get(ref.init_state(jax.random.key(1)))
  # A first step so that B is not zero (the gradient of A is zero while B is).
  batch = train_utils.make_batch(ref.config, seed=1)
  state, _ = ref(jax.device_put(host_state, ref.state_shardings), ref.shard_batch(batch))
  host_state = jax.device_get(state)
  ref_state, ref_m = ref(jax.device_put(host_state, ref.state_shardings), ref.shard_batch(batch))
  ref_m, ref_p = jax.device_get(ref_m), jax.device_get(ref_state["params"])

  step = _step("sharded", (1, 2, 2, 2), **{"train.micro_batches": 2})
  assert step.micro_batches(8) == 2
  step.set_base(jax.device_get(ref.base))
  state = jax.device_put(host_state, step.state_shardings)
  wi_a = state["params"]["blocks"][0]["ffn"]["wi_gate"]["a"]
  assert wi_a.sharding.spec[1] == "expert"
  assert step.base["blocks"][0]["ffn"]["wi_gate"].sharding.spec[1] == "expert"
  new_state, m = step(state, step.shard_batch(batch))
  m, p = jax.device_get(m), jax.device_get(new_state["params"])
  np.testing.assert_allclose(m["loss/total"], ref_m["loss/total"], rtol=1e-5)
  _rel_close(m["grads"], ref_m["grads"], 1e-4, "grads ")
  _rel_close(p, ref_p, 1e-5, "adapters ")


def test_kill_and_restore_of_an_adapter_checkpoint_reproduces_the_next_steps(tmp_path):
  step = _step("single")
  b = step.shard_batch(train_utils.make_batch(step.config, seed=2))
  ck = ckpt_lib.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=2, async_save=True)
  state = step.init_state(jax.random.key(1))
  state, _ = step(state, b)
  ck.maybe_save(1, state, {"data_position": 7, "lora_base": "seed:0"})
  state, _ = step(state, b)
  want = jax.device_get(state)
  ck.close()
  del state
  ck2 = ckpt_lib.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=2, async_save=True)
  # The checkpoint holds the adapters and their optimizer state, not the base.
  saved = ck2.saved_state_metadata(1)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(saved)]
  assert all(p.startswith("['params']") and p.endswith(("['a']", "['b']")) or
             p.startswith(("['opt_state']", "['step']", "['rng']")) for p in paths), paths
  n_saved = sum(np.prod(x.shape) for x in jax.tree.leaves(saved["params"]))
  n_base = sum(x.size for x in jax.tree.leaves(step.base))
  assert n_saved * 5 < n_base          # rank 4 on the 64-wide tiny model: 12% of the base
  at, state, meta = ck2.restore_latest(step.abstract_state())
  assert at == 1 and meta["lora_base"] == "seed:0"
  state, _ = step(state, b)
  assert _leaves_equal(jax.device_get(state), want)
  ck2.close()


def test_the_model_the_step_runs_is_the_base_with_the_adapters_merged(default_emitters_jit):
  step = _step("single")
  state = step.init_state(jax.random.key(1))
  tokens = jnp.asarray(train_utils.make_batch(step.config, seed=3)["tokens"])
  jit = default_emitters_jit   # two programs compared bit for bit
  with sharding.use_mesh(step.mesh, step.rules):
    got = jit(lambda a, t: qwen3_5.forward(step.model_cfg, step.model_params(a), t))(
        state["params"], tokens)
    want = jit(lambda b, t: qwen3_5.forward(step.model_cfg, b, t))(step.base, tokens)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))   # B = 0 at init
