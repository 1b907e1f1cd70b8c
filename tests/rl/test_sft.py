"""The SFT warm start: losses, copy-drill rows, batches, and reuse of saved SFT params."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_cpu
from envs.chat import tokenizer
from models import qwen3_5
from rl import params_io
from rl import sft
from rl.metrics import Metrics
from rl.train_step import token_logprobs


def test_length_grouped_batches_cover_each_row_once_with_little_padding():
  rng = np.random.default_rng(0)
  lengths = rng.integers(100, 3000, 200)
  rows = np.arange(200)
  batches = sft.length_grouped_batches(rows, lengths, 8, np.random.default_rng(1))
  assert all(len(b) == 8 for b in batches)
  assert sorted(np.concatenate(batches).tolist()) == rows.tolist()
  grouped = np.mean([lengths[b].max() for b in batches])
  random = np.mean([lengths[b].max() for b in np.split(rng.permutation(rows), 25)])
  assert grouped < 0.8 * random
  assert len(sft.length_grouped_batches(np.arange(20), lengths, 8, rng)) == 2  # 4 rows dropped


def test_sft_loss_adds_the_weighted_next_token_loss_over_the_valid_length():
  c = tiny_cpu.get_config()
  cfg = qwen3_5.config_from_dict(c.model)
  params = qwen3_5.init_params(cfg, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(3, 1000, (2, 12)).astype(np.int32)
  mask = np.zeros((2, 12), np.int32)
  mask[:, 8:10] = 1
  batch = {"tokens": tokens, "loss_mask": mask, "lengths": np.array([12, 10], np.int32)}
  lp = np.asarray(token_logprobs(cfg, params, tokens, 1.0)[0])
  want = -(lp * mask).sum() / mask.sum()
  lm = -(lp[0, 1:12].sum() + lp[1, 1:10].sum()) / (11 + 9)
  np.testing.assert_allclose(float(sft.sft_loss(cfg, params, batch)), want, rtol=1e-5)
  np.testing.assert_allclose(float(sft.sft_loss(cfg, params, batch, 0.5)), want + 0.5 * lm,
                             rtol=1e-5)


def _sft_step(c, cfg, params, batch, drill):
  """(new params, (loss, grad norm, drill loss), temporary bytes) of one compiled SFT step."""
  opt = sft.sft_optimizer(c)
  step, _ = sft.sft_steps(c, cfg, opt)
  params = jax.tree.map(jnp.copy, params)    # the step donates its params and state
  state = opt.init(params)
  compiled = step.lower(params, state, batch, drill).compile()
  new, _, loss, gnorm, drill_loss = compiled(params, state, batch, drill)
  return new, (float(loss), float(gnorm), float(drill_loss)), \
      compiled.memory_analysis().temp_size_in_bytes


def test_micro_batched_sft_steps_take_the_whole_batchs_loss_gradient_and_update():
  """sft.micro_batches runs a step's rows a micro-batch at a time, in less memory: with the
  weights of the whole batch (its assistant tokens, its valid positions for the
  language-modelling term) the summed loss, the gradient's norm and the updated params are the
  whole batch's. 4 does not divide 6 rows, so the step runs 3 micro-batches of 2; the drill's
  rows are added once."""
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.sft.lm_loss_weight, c.sft.copy_drill_weight = 0.5, 0.25
    c.sft.lr, c.sft.warmup_steps, c.sft.schedule = 1e-3, 0, "constant"
    # Adam's first step moves each weight by lr * g / (|g| + eps): with the usual eps a
    # gradient entry within rounding of zero moves by up to lr whichever way it rounds; with
    # eps = 1 the move is ~lr * g, so equal updates mean equal gradients, entry by entry.
    c.optim.eps = 1.0
  cfg = qwen3_5.config_from_dict(c.model)
  params = qwen3_5.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(9, 1000, (6, 96)).astype(np.int32)
  lengths = np.array([96, 80, 52, 96, 36, 68], np.int32)
  mask = np.zeros((6, 96), np.float32)
  for r, (a, b) in enumerate([(48, 80), (32, 44), (20, 52), (12, 16), (24, 36), (40, 68)]):
    mask[r, a:b] = 1                       # a different number of assistant tokens a row
  batch = {"tokens": tokens, "loss_mask": mask, "lengths": lengths}
  drill = sft.copy_drill_batch(rng, rows=2, length=5, low=9, high=1000)
  runs = {}
  for micro in (1, 4):
    with c.unlocked():
      c.sft.micro_batches = micro
    runs[micro] = _sft_step(c, cfg, params, batch, drill)
  (whole, figures, whole_temp), (new, micro_figures, micro_temp) = runs[1], runs[4]
  np.testing.assert_allclose(micro_figures, figures, rtol=2e-5)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(whole)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-8)
  moved = [bool((np.asarray(a) != np.asarray(b)).any())
           for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(params))]
  assert sum(moved) > len(moved) / 2
  assert micro_temp < 0.6 * whole_temp, (micro_temp, whole_temp)
  np.testing.assert_allclose(  # the weights' loss is sft_loss
      float(sft.weighted_token_loss(cfg, params, {"tokens": tokens, "weights":
                                                    sft.sft_token_weights(batch, 0.5)})),
      float(sft.sft_loss(cfg, params, batch, 0.5)), rtol=1e-5)


def test_copy_drill_rows_repeat_their_first_half_and_score_only_the_predictable_copy():
  d = sft.copy_drill_batch(np.random.default_rng(0), rows=4, length=6, low=9, high=20)
  assert d["tokens"].shape == (4, 12) and d["tokens"].dtype == np.int32
  np.testing.assert_array_equal(d["tokens"][:, :6], d["tokens"][:, 6:])
  assert d["tokens"].min() >= 9 and d["tokens"].max() < 20
  np.testing.assert_array_equal(d["loss_mask"][0], [0] * 7 + [1] * 5)
  np.testing.assert_array_equal(d["lengths"], [12] * 4)


def test_long_copy_drill_rows_put_the_copy_at_varying_offsets_so_position_cannot_solve_them():
  n, row_len = 6, 40
  d = sft.copy_drill_batch(np.random.default_rng(0), rows=64, length=n, low=9, high=20,
                            row_len=row_len)
  assert d["tokens"].shape == (64, row_len) and d["tokens"].min() >= 9 and d["tokens"].max() < 20
  np.testing.assert_array_equal(d["lengths"], [row_len] * 64)
  offsets = []
  for tokens, mask in zip(d["tokens"], d["loss_mask"]):
    scored = np.flatnonzero(mask)
    assert len(scored) == n - 1 and np.all(np.diff(scored) == 1)
    copy_start = scored[0] - 1
    copy = tokens[copy_start:copy_start + n]
    # The copied segment occurs in full earlier in the row, ending before the copy begins.
    sources = [s for s in range(copy_start - n + 1) if np.array_equal(tokens[s:s + n], copy)]
    assert sources
    offsets.append(copy_start - sources[-1])
  assert min(offsets) >= n and len(set(offsets)) > 10


def test_ordinary_id_range_excludes_every_control_token():
  lo, hi = tokenizer.ordinary_id_range("tiny", 1024)
  assert (lo, hi) == (len(tokenizer.TINY_SPECIAL_IDS), 1024)
  lo, hi = tokenizer.ordinary_id_range("qwen3_5", 248320)
  assert lo == 0 and hi <= min(tokenizer.QWEN3_5_SPECIAL_IDS.values())
  with pytest.raises(ValueError, match="special_ids"):
    tokenizer.ordinary_id_range("gpt2", 100)


def test_sft_train_loss_adds_the_weighted_copy_drill_loss(tmp_path):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
    c.sft.steps, c.sft.batch_size, c.sft.lr, c.sft.pad_multiple = 1, 2, 1e-3, 0
    c.sft.warmup_steps = 0
    c.sft.copy_drill_rows, c.sft.copy_drill_len, c.sft.copy_drill_weight = 3, 5, 0.5
    c.loop.tensorboard = False
  cfg = qwen3_5.config_from_dict(c.model)
  params = params_io.init_params(c)
  tokens = np.random.default_rng(0).integers(9, 1000, (2, 16)).astype(np.int32)
  mask = np.zeros((2, 16), np.float32)
  mask[:, 10:14] = 1
  data = {"tokens": tokens, "loss_mask": mask, "lengths": np.array([16, 16], np.int32)}
  metrics = Metrics(str(tmp_path), False)
  trained = sft.sft_train(c, data, params, metrics)
  metrics.close()
  logged = json.loads(open(tmp_path / "metrics.jsonl").read().splitlines()[0])
  # The step's drill rows, redrawn from the same seed; the loss is taken before the update.
  drill = sft.copy_drill_batch(np.random.default_rng([c.seed, 1]), 3, 5, 9, 1024,
                                row_len=c.sft.copy_drill_row_len)
  want_drill = float(sft.sft_loss(cfg, params, drill))
  want = float(sft.sft_loss(cfg, params, data)) + 0.5 * want_drill
  np.testing.assert_allclose(logged["copy_drill_loss"], want_drill, rtol=1e-5)
  np.testing.assert_allclose(logged["loss"], want, rtol=1e-5)
  assert not jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, trained))


def test_drill_only_steps_train_on_the_drill_rows_alone(tmp_path):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
    c.sft.steps, c.sft.batch_size, c.sft.lr, c.sft.pad_multiple = 2, 2, 1e-3, 0
    c.sft.warmup_steps, c.sft.schedule = 0, "constant"
    c.sft.copy_drill_rows, c.sft.copy_drill_len, c.sft.copy_drill_row_len = 3, 5, 24
    c.sft.copy_drill_only_steps = 1
    c.loop.tensorboard = False
  cfg = qwen3_5.config_from_dict(c.model)
  params = params_io.init_params(c)
  data = {"tokens": np.random.default_rng(0).integers(9, 1000, (2, 16)).astype(np.int32),
          "loss_mask": np.pad(np.ones((2, 4), np.float32), ((0, 0), (10, 2))),
          "lengths": np.array([16, 16], np.int32)}
  metrics = Metrics(str(tmp_path), False)
  sft.sft_train(c, data, params, metrics)
  metrics.close()
  first, second = [json.loads(l) for l in open(tmp_path / "metrics.jsonl").read().splitlines()]
  drill = sft.copy_drill_batch(np.random.default_rng([c.seed, 1]), 3, 5, 9, 1024, row_len=24)
  want = float(sft.sft_loss(cfg, params, drill))
  # Step 1: the drill loss alone (no trajectory term); step 2: trajectories + drill again.
  np.testing.assert_allclose([first["loss"], first["copy_drill_loss"]], [want, want], rtol=1e-5)
  assert second["loss"] > second["copy_drill_loss"] + 1.0
  with c.unlocked():
    c.sft.copy_drill_rows = 0
  with pytest.raises(ValueError, match="copy_drill_only_steps=1 needs sft.copy_drill_rows"):
    sft.sft_train(c, data, params)


def test_sft_params_saved_from_another_start_are_refused_not_reused(tmp_path):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
    c.sft.dir = str(tmp_path / "sft")
  params = params_io.init_params(c)
  params_io.save_params(c.sft.dir, params, {"steps": 4, "start": "another-base"}, 4)
  with pytest.raises(ValueError, match="trained from another start"):
    sft.start_params(c)
  assert os.path.isdir(os.path.join(c.sft.dir, "4"))          # nothing saved is removed
  params_io.save_params(c.sft.dir, params, {"steps": 5, "start": params_io.start_fingerprint(c)}, 5)
  got = sft.start_params(c)
  assert jax.tree.structure(got) == jax.tree.structure(params)


def test_tiny_config_variants_build_the_base_in_two_stages_on_content_copy_rows():
  base_v, copy_v = tiny_cpu.get_config("base"), tiny_cpu.get_config("copy")
  # Stage 1 is drill-only from a random init; stage 2 starts from its export.
  assert copy_v.sft.copy_drill_only_steps == copy_v.sft.steps > 0 and copy_v.sft.copy_drill_rows
  assert not copy_v.train.init_from and base_v.train.init_from == copy_v.sft.export_hf
  # Both use content-copy rows (copy at a random offset), never the positional `x x` rows.
  for v in (base_v, copy_v):
    assert v.sft.copy_drill_row_len > 2 * v.sft.copy_drill_len
  assert base_v.sft.export_hf == tiny_cpu.get_config().train.init_from
  with pytest.raises(ValueError, match="'base' or 'copy'"):
    tiny_cpu.get_config("large")


def test_sft_on_tasks_without_an_oracle_is_refused_before_any_world_is_rendered(tmp_path):
  (tmp_path / "world").mkdir()
  (tmp_path / "tasks.jsonl").write_text(json.dumps(dict(
      id="mine", split="train", prompt="p", domain="d", world_dir="world",
      rubric=[{"type": "judge", "instruction": "ok"}])) + "\n")
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.envs.tasks_file = str(tmp_path / "tasks.jsonl")
    c.envs.worlds_root = str(tmp_path / "worlds")
    c.workdir = str(tmp_path / "runs")
  with pytest.raises(ValueError, match=r"1 of the 1 SFT tasks have none \(e.g. \['mine'\]\).*"
                     r"envs.tasks_file=.*--config.loop.sft_first=False"):
    sft.run_sft(c)
  assert not os.path.exists(c.envs.worlds_root)


def test_bfloat16_params_take_two_sft_steps_keeping_every_leafs_dtype():
  """model.param_dtype=bfloat16: the SFT step rounds AdamW's float32 updates into the bfloat16
  params and keeps each moment in its dtype, so its outputs have its inputs' types (the next
  step reuses the compiled program and takes over the buffers it is given); the loss stays
  finite and the params move."""
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.model.param_dtype = c.model.dtype = "bfloat16"
    c.sft.lr, c.sft.warmup_steps, c.sft.schedule = 1e-3, 0, "constant"
  cfg = qwen3_5.config_from_dict(c.model)
  params = qwen3_5.init_params(cfg, jax.random.key(0))
  opt = sft.sft_optimizer(c)
  opt_state = opt.init(params)
  step, _ = sft.sft_steps(c, cfg, opt)
  dtypes = lambda tree: [(jax.tree_util.keystr(p), x.dtype)
                         for p, x in jax.tree_util.tree_leaves_with_path(tree)]
  assert {d for _, d in dtypes(params)} == {np.dtype(jnp.bfloat16)}
  start = dtypes({"params": params, "opt_state": opt_state})
  tokens = np.random.default_rng(0).integers(9, 1000, (2, 16)).astype(np.int32)
  batch = {"tokens": tokens, "loss_mask": np.pad(np.ones((2, 4), np.float32), ((0, 0), (10, 2))),
           "lengths": np.array([16, 16], np.int32)}
  new = jax.tree.map(jnp.copy, params)
  for _ in range(2):
    given = new
    new, opt_state, loss, _, _ = step(new, opt_state, batch, None)
    assert all(x.is_deleted() for x in jax.tree.leaves(given))   # donated: one copy held
    assert np.isfinite(float(loss))
    assert dtypes({"params": new, "opt_state": opt_state}) == start
  moved = [bool((np.asarray(a, np.float32) != np.asarray(b, np.float32)).any())
           for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params))]
  assert sum(moved) > len(moved) / 2, moved


def test_start_params_only_loads_and_warm_start_trains_only_when_nothing_is_saved(
    tmp_path, monkeypatch):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
    c.sft.dir = str(tmp_path / "sft")
  assert c.loop.sft_first and c.sft.steps
  with pytest.raises(FileNotFoundError, match="warm_start"):   # no training behind a getter
    sft.start_params(c)
  trained = []

  def recording_run_sft(config, metrics=None):
    trained.append(config.sft.dir)
    params_io.save_params(config.sft.dir, params_io.init_params(config),
                          {"steps": 1, "start": params_io.start_fingerprint(config)}, 1)

  monkeypatch.setattr(sft, "run_sft", recording_run_sft)
  assert sft.warm_start(c) and trained == [c.sft.dir]
  assert not sft.warm_start(c) and trained == [c.sft.dir]      # saved: read, not retrained
  assert sft.start_params(c) is not None
