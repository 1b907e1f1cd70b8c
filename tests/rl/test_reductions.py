"""Loss reductions: hand-made batches with known answers, numpy transcriptions, micro-batching."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl import reductions

MODES = ["token_mean", "prompt_mean", "sequence_mean", "seq_mean_token_sum_norm"]

# Two prompts of two samples. Prompt 0 has long answers, prompt 1 short ones, so the token
# mean is dominated by prompt 0's tokens while the prompt mean weighs both prompts equally.
# Masked positions hold 100.0 to show that they are ignored.
_MASK = np.array([[1, 1, 1, 1],
                  [1, 1, 0, 0],
                  [1, 0, 0, 0],
                  [1, 0, 0, 0]], np.float32)
_LOSS = np.array([[1, 1, 1, 1],
                  [3, 3, 100, 100],
                  [10, 100, 100, 100],
                  [6, 100, 100, 100]], np.float32)
_GROUPS = np.array([0, 0, 1, 1], np.int32)


@pytest.mark.parametrize("mode,max_len,expected", [
    ("token_mean", None, (4 + 6 + 10 + 6) / 8),                     # 3.25
    ("prompt_mean", None, ((4 + 6) / 6 + (10 + 6) / 2) / 2),        # 4.8333
    ("sequence_mean", None, (1 + 3 + 10 + 6) / 4),                  # 5.0
    ("seq_mean_token_sum_norm", None, (4 + 6 + 10 + 6) / 4 / 4),    # 1.625
    ("seq_mean_token_sum_norm", 8, (4 + 6 + 10 + 6) / 8 / 4),       # 0.8125
])
def test_hand_made_batch(mode, max_len, expected):
  got = reductions.reduce_loss(jnp.asarray(_LOSS), jnp.asarray(_MASK), jnp.asarray(_GROUPS), mode,
                         max_seq_len=max_len)
  np.testing.assert_allclose(float(got), expected, rtol=1e-6)


def test_token_mean_differs_from_prompt_mean():
  args = (jnp.asarray(_LOSS), jnp.asarray(_MASK), jnp.asarray(_GROUPS))
  tm = float(reductions.reduce_loss(*args, "token_mean"))
  pm = float(reductions.reduce_loss(*args, "prompt_mean"))
  assert abs(tm - 3.25) < 1e-6 and abs(pm - 29 / 6) < 1e-6
  assert abs(tm - pm) > 1.0


def test_dead_rows_neither_add_nor_dilute():
  """A padding row (empty mask) in its own group changes no reduction."""
  mask = np.concatenate([_MASK, np.zeros((1, 4), np.float32)])
  loss = np.concatenate([_LOSS, np.full((1, 4), 7.0, np.float32)])
  groups = np.array([0, 0, 1, 1, 5], np.int32)
  for mode in MODES:
    a = reductions.reduce_loss(jnp.asarray(_LOSS), jnp.asarray(_MASK), jnp.asarray(_GROUPS), mode)
    b = reductions.reduce_loss(jnp.asarray(loss), jnp.asarray(mask), jnp.asarray(groups), mode)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6, err_msg=mode)


def _numpy_reduce(loss, mask, groups, mode, max_len=None):
  """Direct transcription of docs/design.md, "Loss reductions" (live sequences / groups only)."""
  n = mask.sum(1)
  live = n > 0
  if mode == "token_mean":
    return (mask * loss).sum() / mask.sum()
  if mode == "sequence_mean":
    return np.mean([(mask[i] * loss[i]).sum() / n[i] for i in range(len(n)) if live[i]])
  if mode == "seq_mean_token_sum_norm":
    max_len = max_len or loss.shape[1]
    return np.mean([(mask[i] * loss[i]).sum() / max_len for i in range(len(n)) if live[i]])
  if mode == "prompt_mean":
    per_prompt = []
    for g in np.unique(groups):
      rows = groups == g
      if n[rows].sum() == 0:
        continue
      per_prompt.append((mask[rows] * loss[rows]).sum() / n[rows].sum())
    return np.mean(per_prompt)
  raise ValueError(mode)


@pytest.mark.parametrize("mode", MODES)
def test_random_batches_match_numpy(mode):
  rng = np.random.default_rng(0)
  for trial in range(5):
    b, t = 12, 9
    lengths = rng.integers(0, t + 1, size=b)
    lengths[0] = t                                   # at least one live row
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    mask[:, 0] *= rng.integers(0, 2, size=b)         # some holes, not only right padding
    mask[0, 0] = 1
    loss = rng.normal(size=(b, t)).astype(np.float32)
    groups = rng.permutation(np.repeat(rng.choice(1000, 4, replace=False), 3)).astype(np.int32)
    got = reductions.reduce_loss(jnp.asarray(loss), jnp.asarray(mask), jnp.asarray(groups), mode)
    want = _numpy_reduce(loss, mask, groups, mode)
    np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-6, err_msg=f"{mode} {trial}")


def test_unknown_mode_is_an_error():
  with pytest.raises(ValueError, match="unknown loss reduction"):
    reductions.reduce_loss(jnp.ones((1, 1)), jnp.ones((1, 1)), jnp.zeros((1,), jnp.int32), "nope")


# ----------------------------------------------------------------------------- micro-batching


def _stand_in_batch(seed=0, b=8, t=6, d=5):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, t + 1, size=b)
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
  return {
      "x": jnp.asarray(rng.normal(size=(b, t, d)).astype(np.float32)),
      "mask": jnp.asarray(mask),
      "groups": jnp.asarray(np.array([3, 9, 3, 9, 1, 1, 9, 3], np.int32)[:b]),
  }


def _stand_in_params(d=5):
  return {"w": jnp.linspace(-0.5, 0.7, d, dtype=jnp.float32), "b": jnp.float32(0.1)}


def _token_loss(params, x):
  """A small differentiable stand-in for -A * ratio: [batch, seq]."""
  h = x @ params["w"] + params["b"]
  return jnp.tanh(h) ** 2 + 0.3 * h


def _loss_fn(params, mb):
  l = _token_loss(params, mb["x"])
  loss = jnp.sum(mb["weights"] * l)
  return loss, {"tokens": jnp.sum(mb["mask"])}


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_give_same_loss_and_grads(mode):
  batch = _stand_in_batch()
  params = _stand_in_params()
  batch["weights"] = reductions.reduction_weights(batch["mask"], batch["groups"], mode)

  direct = lambda p: reductions.reduce_loss(_token_loss(p, batch["x"]), batch["mask"], batch["groups"],
                                      mode)
  ref_loss, ref_grads = jax.value_and_grad(direct)(params)
  for n in (1, 2, 4):
    fn = jax.jit(lambda p, bt, n=n: reductions.microbatched_value_and_grad(_loss_fn, p, bt, n))
    (loss, aux), grads = fn(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, err_msg=f"{mode} n={n}")
    np.testing.assert_allclose(float(aux["tokens"]), float(batch["mask"].sum()))
    for k in grads:
      np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(ref_grads[k]), rtol=1e-5,
                                 atol=1e-7, err_msg=f"{mode} n={n} {k}")


def test_naive_per_micro_batch_mean_would_differ():
  """Guards the test above: averaging per-micro-batch token means is NOT the token mean."""
  batch = _stand_in_batch()
  l = _token_loss(_stand_in_params(), batch["x"])
  m = batch["mask"]
  exact = float(reductions.reduce_loss(l, m, batch["groups"], "token_mean"))
  parts = reductions.split_micro_batches({"l": l, "m": m}, 4)
  naive = np.mean([float((parts["l"][k] * parts["m"][k]).sum() / parts["m"][k].sum())
                   for k in range(4)])
  assert abs(naive - exact) > 1e-3


def test_split_is_strided():
  x = jnp.arange(8)
  np.testing.assert_array_equal(np.asarray(reductions.split_micro_batches(x, 2)),
                                [[0, 2, 4, 6], [1, 3, 5, 7]])
  with pytest.raises(ValueError, match="not divisible"):
    reductions.split_micro_batches(jnp.arange(6), 4)


@pytest.mark.parametrize("rows, requested, ways, runs", [
    (16, 8, 1, 8),    # one device: as asked
    (16, 8, 8, 2),    # the tiny default on 8 devices: 2 micro-batches of one row a device
    (16, 4, 2, 4),    # 4 rows a micro-batch over 2 devices: as asked
    (8, 2, 8, 1),     # 4 rows a micro-batch for 8 devices: the whole mini-batch, a row each
    (24, 2, 8, 1),    # 12 rows over 8 devices is uneven; 24 is not
    (48, 4, 4, 4)])   # 12 rows over 4: as asked
def test_micro_batches_give_every_device_the_same_whole_rows(rows, requested, ways, runs):
  assert reductions.micro_batch_count(rows, requested, ways) == runs


# ----------------------------------------------------------------------------- dead rows skipped


def _batch_with_dead_group(b=8):
  """Group 9 (rows 1, 3, 6) has no loss token: the rows of a filtered, zero-variance group."""
  batch = _stand_in_batch(b=b)
  dead = np.asarray(batch["groups"]) == 9
  batch["mask"] = jnp.asarray(np.asarray(batch["mask"]) * ~dead[:, None])
  return batch, dead


def test_pack_live_rows_fills_first_micro_batches_and_keeps_every_row():
  batch, dead = _batch_with_dead_group()
  host = {k: np.asarray(v) for k, v in batch.items()}
  host["row"] = np.arange(8)
  packed = reductions.pack_live_rows(host, ~dead, 4)
  assert sorted(packed["row"]) == list(range(8))
  for k in ("x", "mask", "groups"):      # rows move whole
    np.testing.assert_array_equal(packed[k], host[k][packed["row"]])
  live_per_micro = (np.asarray(reductions.split_micro_batches(packed["mask"], 4)).sum((1, 2)) > 0)
  # 5 live rows in micro-batches of 2: the first three hold them, the last one is all dead.
  assert live_per_micro.tolist() == [True, True, True, False]


def test_live_rows_drops_zero_variance_groups_only_when_filtering():
  rewards = np.array([1, 0, 1, 1, 0, 0, 1, 1], np.float32)
  groups = np.array([0, 0, 1, 1, 2, 2, 3, 3])
  valid = np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
  mask = np.ones((8, 3), np.float32)
  mask[1] = 0
  np.testing.assert_array_equal(reductions.live_rows(rewards, groups, valid, mask, True),
                                [1, 0, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(reductions.live_rows(rewards, groups, valid, mask, False),
                                [1, 0, 1, 1, 1, 1, 1, 0])


@pytest.mark.parametrize("mode", MODES)
def test_skipping_dead_micro_batches_gives_same_loss_and_grads(mode):
  batch, dead = _batch_with_dead_group()
  batch = reductions.pack_live_rows({k: np.asarray(v) for k, v in batch.items()}, ~dead, 4)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  batch["weights"] = reductions.reduction_weights(batch["mask"], batch["groups"], mode)
  params = _stand_in_params()
  full = jax.jit(lambda p, bt: reductions.microbatched_value_and_grad(_loss_fn, p, bt, 4))
  skip = jax.jit(lambda p, bt: reductions.microbatched_value_and_grad(
      _loss_fn, p, bt, 4, is_live=lambda mb: mb["mask"].sum() > 0))
  (loss_f, aux_f), grads_f = full(params, batch)
  (loss_s, aux_s), grads_s = skip(params, batch)
  np.testing.assert_allclose(float(loss_s), float(loss_f), rtol=1e-6)
  np.testing.assert_allclose(float(aux_s["tokens"]), float(aux_f["tokens"]))
  for k in grads_f:
    np.testing.assert_allclose(np.asarray(grads_s[k]), np.asarray(grads_f[k]), rtol=1e-6, atol=1e-8)


def test_dead_micro_batches_are_not_computed():
  """Poisoned inputs in the dead rows: NaN everywhere when computed (0 * NaN), finite when the
  micro-batch is skipped, which shows the skip really removes the forward and backward."""
  batch, dead = _batch_with_dead_group()
  host = {k: np.asarray(v).copy() for k, v in batch.items()}
  host["x"][dead] = np.nan
  host = reductions.pack_live_rows(host, ~dead, 4)
  # Only the all-dead micro-batch may hold NaN rows; a live one holding dead rows is computed.
  host["x"][np.isnan(host["x"]).any(axis=(1, 2)) & (np.arange(8) % 4 != 3)] = 0.0
  batch = {k: jnp.asarray(v) for k, v in host.items()}
  batch["weights"] = reductions.reduction_weights(batch["mask"], batch["groups"], "token_mean")
  params = _stand_in_params()
  (loss, _), grads = reductions.microbatched_value_and_grad(_loss_fn, params, batch, 4)
  assert np.isnan(float(loss))
  (loss, _), grads = reductions.microbatched_value_and_grad(
      _loss_fn, params, batch, 4, is_live=lambda mb: mb["mask"].sum() > 0)
  assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g)).all() for g in grads.values())


def test_micro_batch_gradients_are_laid_out_like_the_params_they_belong_to():
  """`grad_shardings`: the accumulated gradients come out with the parameters' shardings (the
  accumulator and each micro-batch's gradients are constrained to them), equal in value."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
  spec = jax.sharding.PartitionSpec
  params = _stand_in_params(d=8)
  shardings = {"w": jax.sharding.NamedSharding(mesh, spec("fsdp")),
               "b": jax.sharding.NamedSharding(mesh, spec())}
  batch = _stand_in_batch(d=8)
  batch["weights"] = reductions.reduction_weights(batch["mask"], batch["groups"], "token_mean")
  params = jax.device_put(params, shardings)
  plain = jax.jit(lambda p, bt: reductions.microbatched_value_and_grad(_loss_fn, p, bt, 4))
  laid = jax.jit(lambda p, bt: reductions.microbatched_value_and_grad(
      _loss_fn, p, bt, 4, grad_shardings=shardings))
  (loss, _), grads = laid(params, batch)
  (loss_ref, _), grads_ref = plain(params, batch)
  assert grads["w"].sharding.is_equivalent_to(shardings["w"], 1)
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grads["w"]), np.asarray(grads_ref["w"]), rtol=1e-6)
