"""Fast checks of the RL loop's pieces: intervals, eval summary, task stream, tool subset, sweeps."""
import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from configs import tiny_cpu
from rl import loop
from rl import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bootstrap_ci_brackets_the_mean_and_narrows_with_n():
  rng = np.random.default_rng(0)
  small = (rng.random(40) < 0.3).astype(float)
  big = (rng.random(4000) < 0.3).astype(float)
  lo, hi = loop.bootstrap_ci(small, 2000)
  assert lo <= small.mean() <= hi
  blo, bhi = loop.bootstrap_ci(big, 2000)
  assert bhi - blo < hi - lo
  assert loop.bootstrap_ci(np.zeros(10), 100) == [0.0, 0.0]


@dataclasses.dataclass
class _R:
  task_id: str
  passed: bool
  reward: float
  outcome: str = "ok"


@dataclasses.dataclass
class _T:
  id: str
  family: str = "xlsx_lookup"


def test_summarize_eval_averages_samples_within_a_task_first():
  tasks = [_T("a"), _T("b")]
  res = [_R("a", True, 1.0), _R("a", False, 0.0), _R("b", True, 1.0), _R("b", True, 1.0)]
  s = loop.summarize_eval(res, tasks, 200)
  assert s["n_tasks"] == 2 and s["n_episodes"] == 4
  assert s["pass_at_1"] == pytest.approx(0.75)
  assert s["mean_reward"] == pytest.approx(0.75)
  assert s["pass_at_1_ci95"][0] <= 0.75 <= s["pass_at_1_ci95"][1]
  assert s["outcomes"] == {"ok": 4}
  assert s["by_family"] == {"xlsx_lookup": {"n_tasks": 2, "pass_at_1": 0.75}}
  assert s["per_task_pass"] == {"a": 0.5, "b": 1.0}


def test_summarize_eval_breaks_pass_at_1_down_by_family():
  tasks = [_T("a", "pdf_lookup"), _T("b", "pdf_lookup"), _T("c", "mail_lookup")]
  res = [_R("a", True, 1.0), _R("b", False, 0.0), _R("c", False, 0.0)]
  s = loop.summarize_eval(res, tasks, 100)
  assert s["by_family"] == {"mail_lookup": {"n_tasks": 1, "pass_at_1": 0.0},
                            "pdf_lookup": {"n_tasks": 2, "pass_at_1": 0.5}}


def test_task_stream_is_shuffled_epoch_aware_and_resumable():
  tasks = list(range(10))
  a = loop.TaskStream(tasks, seed=3)
  first = a.take(10)
  assert sorted(first) == tasks and first != tasks  # one epoch = a permutation
  second = a.take(4)
  assert a.position == 14 and a.epoch == pytest.approx(1.4)
  b = loop.TaskStream(tasks, seed=3, position=10)  # resumed from a checkpointed position
  assert b.take(4) == second


class _World:
  def tools(self):
    return [{"type": "function", "function": {"name": n}} for n in ("a", "b", "c")]

  def call_tool(self, name, arguments):
    return (name, arguments)

  def grade(self, answer):
    return answer

  def close(self, reuse=False):
    self.closed = reuse


@dataclasses.dataclass(frozen=True)
class _Spec:
  def start(self):
    return _World()


def test_tool_subset_shows_only_the_named_tools():
  w = loop.ToolSubsetSpec(_Spec(), ("a", "c")).start()
  assert [t["function"]["name"] for t in w.tools()] == ["a", "c"]
  assert w.call_tool("b", {"x": 1}) == ("b", {"x": 1})  # the harness rejects hidden tools
  assert isinstance(loop.ToolSubsetSpec(_Spec(), ()).start(), _World)
  with pytest.raises(ValueError, match="zzz"):
    loop.ToolSubsetSpec(_Spec(), ("a", "zzz")).start().tools()


_READ = {"type": "function", "function": {
    "name": "read", "description": "Read a file.",
    "parameters": {"type": "object", "title": "read_args",
                   "properties": {"path": {"title": "Path", "type": "string"},
                                  "limit": {"title": "Limit", "type": "integer", "default": 5}},
                   "required": ["path"]}}}


def test_compact_tool_schema_keeps_the_name_and_required_typed_parameters():
  assert loop.compact_tool(_READ) == {"type": "function", "function": {
      "name": "read", "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                     "required": ["path"]}}}

  class One(_World):
    def tools(self):
      return [_READ]

  @dataclasses.dataclass(frozen=True)
  class OneSpec:
    def start(self):
      return One()

  w = loop.ToolSubsetSpec(OneSpec(), (), "compact").start()
  assert w.tools() == [loop.compact_tool(_READ)]
  with pytest.raises(ValueError, match="tool_schema"):
    loop.ToolSubsetSpec(OneSpec(), (), "short").start()


def test_init_from_loads_a_hugging_face_checkpoint_and_rejects_other_shapes(tmp_path):
  import jax
  from models import qwen3_5
  c = tiny_cpu.get_config()
  cfg = qwen3_5.config_from_dict(c.model)
  params = qwen3_5.init_params(cfg, jax.random.key(3))
  qwen3_5.save_hf(cfg, params, str(tmp_path / "ck"))
  with c.unlocked():
    c.train.init_from = str(tmp_path / "ck")
  got = loop.init_params(c)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Read straight into the train step's shards: same values, the step's layout.
  from models import sharding as shd
  from rl.train_step import TrainStep
  shardings = TrainStep(c, shd.make_mesh(c.mesh)).state_shardings["params"]
  got = loop.init_params(c, shardings)
  for a, b, sh in zip(jax.tree.leaves(got), jax.tree.leaves(params), jax.tree.leaves(shardings)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding.is_equivalent_to(sh, a.ndim)
  with c.unlocked():
    c.model.hidden_size = 32
  with pytest.raises(ValueError, match="another shape"):
    loop.init_params(c)
  with pytest.raises(ValueError, match="another shape"):
    loop.init_params(c, shardings)
  with c.unlocked():
    c.train.init_from = str(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match="init_from"):
    loop.init_params(c)


def test_length_grouped_batches_cover_each_row_once_with_little_padding():
  rng = np.random.default_rng(0)
  lengths = rng.integers(100, 3000, 200)
  rows = np.arange(200)
  batches = loop.length_grouped_batches(rows, lengths, 8, np.random.default_rng(1))
  assert all(len(b) == 8 for b in batches)
  assert sorted(np.concatenate(batches).tolist()) == rows.tolist()
  grouped = np.mean([lengths[b].max() for b in batches])
  random = np.mean([lengths[b].max() for b in np.split(rng.permutation(rows), 25)])
  assert grouped < 0.8 * random
  assert len(loop.length_grouped_batches(np.arange(20), lengths, 8, rng)) == 2  # 4 rows dropped


def test_sft_loss_adds_the_weighted_next_token_loss_over_the_valid_length():
  import jax
  from models import qwen3_5
  c = tiny_cpu.get_config()
  cfg = qwen3_5.config_from_dict(c.model)
  params = qwen3_5.init_params(cfg, jax.random.key(0))
  tokens = np.random.default_rng(0).integers(3, 1000, (2, 12)).astype(np.int32)
  mask = np.zeros((2, 12), np.int32)
  mask[:, 8:10] = 1
  batch = {"tokens": tokens, "loss_mask": mask, "lengths": np.array([12, 10], np.int32)}
  from rl.train_step import token_logprobs
  lp = np.asarray(token_logprobs(cfg, params, tokens, 1.0)[0])
  sft = -(lp * mask).sum() / mask.sum()
  lm = -(lp[0, 1:12].sum() + lp[1, 1:10].sum()) / (11 + 9)
  np.testing.assert_allclose(float(loop.sft_loss(cfg, params, batch)), sft, rtol=1e-5)
  np.testing.assert_allclose(float(loop.sft_loss(cfg, params, batch, 0.5)), sft + 0.5 * lm,
                             rtol=1e-5)


def test_copy_drill_rows_repeat_their_first_half_and_score_only_the_predictable_copy():
  d = loop.copy_drill_batch(np.random.default_rng(0), rows=4, length=6, low=9, high=20)
  assert d["tokens"].shape == (4, 12) and d["tokens"].dtype == np.int32
  np.testing.assert_array_equal(d["tokens"][:, :6], d["tokens"][:, 6:])
  assert d["tokens"].min() >= 9 and d["tokens"].max() < 20
  np.testing.assert_array_equal(d["loss_mask"][0], [0] * 7 + [1] * 5)
  np.testing.assert_array_equal(d["lengths"], [12] * 4)


def test_long_copy_drill_rows_put_the_copy_at_varying_offsets_so_position_cannot_solve_them():
  n, row_len = 6, 40
  d = loop.copy_drill_batch(np.random.default_rng(0), rows=64, length=n, low=9, high=20,
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
  from envs.chat import tokenizer
  lo, hi = tokenizer.ordinary_id_range("tiny", 1024)
  assert (lo, hi) == (len(tokenizer.TINY_SPECIAL_IDS), 1024)
  lo, hi = tokenizer.ordinary_id_range("qwen3_5", 248320)
  assert lo == 0 and hi <= min(tokenizer.QWEN3_5_SPECIAL_IDS.values())
  with pytest.raises(ValueError, match="special_ids"):
    tokenizer.ordinary_id_range("gpt2", 100)


def test_sft_train_loss_adds_the_weighted_copy_drill_loss(tmp_path):
  import jax
  from models import qwen3_5
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
    c.sft.steps, c.sft.batch_size, c.sft.lr, c.sft.pad_multiple = 1, 2, 1e-3, 0
    c.sft.warmup_steps = 0
    c.sft.copy_drill_rows, c.sft.copy_drill_len, c.sft.copy_drill_weight = 3, 5, 0.5
    c.loop.tensorboard = False
  cfg = qwen3_5.config_from_dict(c.model)
  params = loop.init_params(c)
  tokens = np.random.default_rng(0).integers(9, 1000, (2, 16)).astype(np.int32)
  mask = np.zeros((2, 16), np.float32)
  mask[:, 10:14] = 1
  data = {"tokens": tokens, "loss_mask": mask, "lengths": np.array([16, 16], np.int32)}
  metrics = loop.Metrics(str(tmp_path), False)
  trained = loop.sft_train(c, data, params, metrics)
  metrics.close()
  logged = json.loads(open(tmp_path / "metrics.jsonl").read().splitlines()[0])
  # The step's drill rows, redrawn from the same seed; the loss is taken before the update.
  drill = loop.copy_drill_batch(np.random.default_rng([c.seed, 1]), 3, 5, 9, 1024,
                                row_len=c.sft.copy_drill_row_len)
  want_drill = float(loop.sft_loss(cfg, params, drill))
  want = float(loop.sft_loss(cfg, params, data)) + 0.5 * want_drill
  np.testing.assert_allclose(logged["copy_drill_loss"], want_drill, rtol=1e-5)
  np.testing.assert_allclose(logged["loss"], want, rtol=1e-5)
  assert not jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, trained))


def test_drill_only_steps_train_on_the_drill_rows_alone(tmp_path):
  from models import qwen3_5
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
    c.sft.steps, c.sft.batch_size, c.sft.lr, c.sft.pad_multiple = 2, 2, 1e-3, 0
    c.sft.warmup_steps, c.sft.schedule = 0, "constant"
    c.sft.copy_drill_rows, c.sft.copy_drill_len, c.sft.copy_drill_row_len = 3, 5, 24
    c.sft.copy_drill_only_steps = 1
    c.loop.tensorboard = False
  cfg = qwen3_5.config_from_dict(c.model)
  params = loop.init_params(c)
  data = {"tokens": np.random.default_rng(0).integers(9, 1000, (2, 16)).astype(np.int32),
          "loss_mask": np.pad(np.ones((2, 4), np.float32), ((0, 0), (10, 2))),
          "lengths": np.array([16, 16], np.int32)}
  metrics = loop.Metrics(str(tmp_path), False)
  loop.sft_train(c, data, params, metrics)
  metrics.close()
  first, second = [json.loads(l) for l in open(tmp_path / "metrics.jsonl").read().splitlines()]
  drill = loop.copy_drill_batch(np.random.default_rng([c.seed, 1]), 3, 5, 9, 1024, row_len=24)
  want = float(loop.sft_loss(cfg, params, drill))
  # Step 1: the drill loss alone (no trajectory term); step 2: trajectories + drill again.
  np.testing.assert_allclose([first["loss"], first["copy_drill_loss"]], [want, want], rtol=1e-5)
  assert second["loss"] > second["copy_drill_loss"] + 1.0
  with c.unlocked():
    c.sft.copy_drill_rows = 0
  with pytest.raises(ValueError, match="copy_drill_only_steps=1 needs sft.copy_drill_rows"):
    loop.sft_train(c, data, params)


def test_save_params_keeps_the_newest_save_and_load_params_returns_it(tmp_path):
  import jax
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
  first = loop.init_params(c)
  second = jax.tree.map(lambda x: x + 1.0, first)
  d = str(tmp_path / "sft")
  assert loop.load_params(d, c) is None
  loop.save_params(d, first, {"steps": 50}, 50)
  loop.save_params(d, second, {"steps": 100}, 100)
  got = loop.load_params(d, c)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(second)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_start_fingerprint_follows_the_starting_weights(tmp_path):
  c = tiny_cpu.get_config()
  base = tmp_path / "base"
  base.mkdir()
  (base / "config.json").write_text("{}")
  blob = bytearray(3 << 20)                       # > 2 MiB: head and tail are read
  (base / "model.safetensors").write_bytes(bytes(blob))
  with c.unlocked():
    c.train.init_from = str(base)
  first = loop.start_fingerprint(c)
  assert loop.start_fingerprint(c) == first
  blob[-1] = 1                                    # a change in the last MiB
  (base / "model.safetensors").write_bytes(bytes(blob))
  assert loop.start_fingerprint(c) != first
  c.train.init_from = ""
  assert loop.start_fingerprint(c) == f"random-init-seed-{c.seed}"
  c.train.init_from = str(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match="is not a directory"):
    loop.start_fingerprint(c)


def test_sft_params_saved_from_another_start_are_refused_not_reused(tmp_path):
  import jax
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
    c.sft.dir = str(tmp_path / "sft")
  params = loop.init_params(c)
  loop.save_params(c.sft.dir, params, {"steps": 4, "start": "another-base"}, 4)
  with pytest.raises(ValueError, match="trained from another start"):
    loop.start_params(c)
  assert os.path.isdir(os.path.join(c.sft.dir, "4"))          # nothing saved is removed
  loop.save_params(c.sft.dir, params, {"steps": 5, "start": loop.start_fingerprint(c)}, 5)
  got = loop.start_params(c)
  assert jax.tree.structure(got) == jax.tree.structure(params)


_SAVE_ON_16_DEVICES = """
import sys
sys.path.insert(0, sys.argv[1])
import jax
from configs import tiny_cpu
from rl import loop
c = tiny_cpu.get_config()
with c.unlocked():
  c.train.init_from = ""
params = jax.tree.map(lambda x: x + 1.0, loop.init_params(c))
mesh = jax.sharding.Mesh(jax.devices(), ("d",))
on_all = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
loop.save_params(sys.argv[2], jax.device_put(params, on_all), {"steps": 4}, 4)
"""


def test_load_params_restores_params_saved_on_another_topology(tmp_path):
  # A CPU run's SFT params read by a GPU run (or another mesh): orbax refuses a target without
  # shardings when the saved topology differs, which once sent such a run back to SFT.
  import subprocess
  import jax
  d = str(tmp_path / "sft")
  # Saved on more devices than this process has (orbax accepts a shardless target only when
  # the saved topology fits the present one).
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=16",
             JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-c", _SAVE_ON_16_DEVICES, ROOT, d], env=env, check=True,
                 capture_output=True, timeout=300)
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
  got = loop.load_params(d, c)
  want = jax.tree.map(lambda x: x + 1.0, loop.init_params(c))
  assert jax.device_count() < 16 and got is not None
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_params_of_a_directory_not_written_yet_is_none_with_or_without_meta(tmp_path):
  c = tiny_cpu.get_config()
  missing = str(tmp_path / "sft")
  assert loop.load_params(missing, c) is None
  assert loop.load_params_and_meta(missing, c) == (None, None)


def test_load_params_names_saved_params_that_do_not_restore(tmp_path):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
  d = str(tmp_path / "sft")
  loop.save_params(d, loop.init_params(c), {"steps": 4}, 4)
  for root, _, files in os.walk(os.path.join(d, "4", "state")):
    for f in files:
      os.remove(os.path.join(root, f))
  with pytest.raises(ValueError, match=r"holds saved params \(step 4\) that do not restore"):
    loop.load_params(d, c)
  assert os.path.isdir(os.path.join(d, "4"))   # nothing saved is removed


def test_tiny_config_eval_subset_has_at_least_160_held_out_tasks():
  c = tiny_cpu.get_config()
  ev = loop.select_tasks(c, "eval", c.loop.eval_levels, c.loop.eval_max_tasks)
  tr = loop.select_tasks(c, "train", c.loop.levels)
  assert len(ev) >= 160
  assert not {t.world_id for t in ev} & {t.world_id for t in tr}


def test_families_filter_keeps_only_the_named_train_families_and_rejects_unknown_ones():
  c = tiny_cpu.get_config()
  every = loop.select_tasks(c, "train", c.loop.levels)
  picked = loop.select_tasks(c, "train", c.loop.levels, families=("docx_lookup", "pdf_lookup"))
  assert {t.family for t in picked} == {"docx_lookup", "pdf_lookup"}
  assert [t.id for t in picked] == [t.id for t in every if t.family in ("docx_lookup", "pdf_lookup")]
  with pytest.raises(ValueError, match="docs_lookup"):
    loop.select_tasks(c, "train", c.loop.levels, families=("docs_lookup",))


def _rates_file(tmp_path, rates: dict) -> str:
  path = str(tmp_path / "rates.json")
  with open(path, "w") as f:
    json.dump({"pass_rate": rates, "samples_per_task": 4}, f)
  return path


def test_train_pool_keeps_only_tasks_whose_measured_pass_rate_is_in_range(tmp_path):
  c = tiny_cpu.get_config()
  every = loop.select_tasks(c, "train", c.loop.levels)
  rates = {t.id: [0.0, 0.25, 0.5, 1.0][i % 4] for i, t in enumerate(every[:40])}
  with c.unlocked():
    c.loop.train_pass_rates = _rates_file(tmp_path, rates)
  assert [t.id for t in loop.train_pool(c)] == [t.id for t in every]   # no range: every task
  c.loop.train_pass_range = (0.2, 0.8)
  kept = loop.train_pool(c)
  # In range and in split order; tasks the file does not rate are dropped with the rest.
  assert [t.id for t in kept] == [t.id for t in every[:40] if 0.2 <= rates[t.id] <= 0.8]
  assert len(kept) == 20


def test_train_pool_filter_names_each_bad_setting(tmp_path):
  c = tiny_cpu.get_config()
  c.loop.train_pass_range = (0.2, 0.8)
  with pytest.raises(ValueError, match="names no file"):
    loop.train_pool(c)
  c.loop.train_pass_rates = str(tmp_path / "missing.json")
  with pytest.raises(FileNotFoundError, match="mode=pass_rates"):
    loop.train_pool(c)
  (tmp_path / "bad.json").write_text('{"rates": {}}')
  c.loop.train_pass_rates = str(tmp_path / "bad.json")
  with pytest.raises(ValueError, match="not a pass-rate file"):
    loop.train_pool(c)
  c.loop.train_pass_rates = _rates_file(tmp_path, {"train-none-000": 0.5})
  with pytest.raises(ValueError, match="no train task has a measured pass rate"):
    loop.train_pool(c)
  c.loop.train_pass_range = (0.8, 0.2)
  with pytest.raises(ValueError, match="lo <= hi"):
    loop.train_pool(c)


def test_pass_rate_histogram_counts_tasks_by_passing_rollouts():
  from rl import pass_rates
  hist = pass_rates.histogram({"a": 0.0, "b": 0.25, "c": 0.25, "d": 1.0}, 4)
  assert hist == {"0": 1, "1": 2, "2": 0, "3": 0, "4": 1}


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


def test_sweep_jobs_cover_both_arms_and_reject_unknown_keys(tmp_path):
  c = tiny_cpu.get_config()
  jobs = sweep.load_sweep(os.path.join(ROOT, "configs/sweeps/loss_reduction.py"))
  assert {j["rl.loss_reduction"] for j in jobs} == {"token_mean", "prompt_mean"}
  assert {j["harness.nudge"] for j in jobs} == {True, False}
  cmds = sweep.job_commands(c, jobs, ["launch.py", "--mode=rl", "--sweep=x", "--dry_run"])
  assert len({name for name, _, _ in cmds}) == 4
  for _, job, args in cmds:
    assert not any(a.startswith(("--sweep", "--dry_run")) for a in args)
    assert f"--config.rl.loss_reduction={job['rl.loss_reduction']}" in args
    assert any(a.startswith("--config.sft.dir=") for a in args)
  with pytest.raises(SystemExit, match="rl.los_reduction"):
    sweep.job_commands(c, [{"rl.los_reduction": "token_mean"}], ["launch.py"])


@pytest.mark.parametrize("name", sorted(
    f for f in os.listdir(os.path.join(ROOT, "configs", "sweeps")) if not f.startswith("_")))
def test_every_sweep_file_makes_one_command_per_job_of_known_keys(name):
  c = tiny_cpu.get_config()
  jobs = sweep.load_sweep(os.path.join(ROOT, "configs", "sweeps", name))
  cmds = sweep.job_commands(c, jobs, ["launch.py", "--mode=rl"])   # exits on an unknown key
  assert len({n for n, _, _ in cmds}) == len(jobs) >= 2


def _token_vs_prompt_mean_sweep(tmp_path):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.workdir = str(tmp_path)
  jobs = [{"name": "tm", "rl.loss_reduction": "token_mean"},
          {"name": "pm", "rl.loss_reduction": "prompt_mean"}]
  return c, sweep.job_commands(c, jobs, ["launch.py"])


def test_sweep_table_reads_summaries(tmp_path):
  c, cmds = _token_vs_prompt_mean_sweep(tmp_path)
  run = tmp_path / "tiny_cpu-tm"
  run.mkdir()
  s = {"pass_at_1": 0.2, "pass_at_1_ci95": [0.1, 0.3], "mean_reward": 0.2}
  (run / "summary.json").write_text(json.dumps({"before_rl": s, "after_rl": dict(s, pass_at_1=0.4)}))
  t = sweep.table(c, cmds)
  assert "| tiny_cpu-tm | token_mean | 0.200 | 0.400 [0.100, 0.300] | +0.200 |" in t
  assert "tiny_cpu-pm" in t and "(no summary)" in t
  run = tmp_path / "tiny_cpu-pm"
  run.mkdir()
  (run / "summary.json").write_text(json.dumps({"before_rl": s, "after_rl": s,
                                                "delta_pass_at_1_ci95": [-0.05, 0.05]}))
  assert "| tiny_cpu-pm | prompt_mean | 0.200 | 0.200 [0.100, 0.300] | +0.000 [-0.050, +0.050] |" \
      in sweep.table(c, cmds)


def test_sweep_table_compares_each_arm_with_the_first_on_paired_tasks(tmp_path):
  c, cmds = _token_vs_prompt_mean_sweep(tmp_path)
  ids = [f"t{i}" for i in range(100)]
  for name, passing in (("tm", 20), ("pm", 30)):   # pm passes tm's 20 tasks and 10 more
    per_task = {t: float(i < passing) for i, t in enumerate(ids)}
    s = {"pass_at_1": passing / 100, "pass_at_1_ci95": [0.0, 1.0], "mean_reward": 0.0,
         "per_task_pass": per_task}
    (tmp_path / f"tiny_cpu-{name}").mkdir()
    (tmp_path / f"tiny_cpu-{name}" / "summary.json").write_text(
        json.dumps({"before_rl": s, "after_rl": s}))
  t = sweep.table(c, cmds)
  assert "after vs tiny_cpu-tm (paired 95% CI)" in t
  row = [r for r in t.splitlines() if r.startswith("| tiny_cpu-pm ")][0]
  cell = row.strip("| ").split(" | ")[-1]
  assert cell.startswith("+0.100 [")
  lo, hi = (float(x) for x in cell[len("+0.100 ["):-1].split(", "))
  assert 0.0 < lo < 0.1 < hi


def test_launch_sweep_dry_run_prints_the_jobs():
  import subprocess
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), "--mode=rl",
                        "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"),
                        "--sweep=" + os.path.join(ROOT, "configs/sweeps/loss_reduction.py"),
                        "--dry_run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.count("--config.rl.loss_reduction=") == 4


def test_launch_pass_rates_mode_needs_a_file_to_write():
  import subprocess
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), "--mode=pass_rates",
                        "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert "set it to a path" in out.stderr and "loop.train_pass_rates" in out.stderr


def test_summary_format_and_improvement_rule():
  c = tiny_cpu.get_config()
  ev = [_T("a"), _T("b")]
  b = {"pass_at_1": 0.2, "pass_at_1_ci95": [0.1, 0.3], "mean_reward": 0.2}
  out = loop._finish({"before_rl": b, "after_rl": dict(b, pass_at_1=0.45, pass_at_1_ci95=[0.35, 0.55])}, c, ev)
  assert out["improved_outside_cis"] and out["delta_pass_at_1"] == pytest.approx(0.25)
  assert out["eval_subset"]["n_tasks"] == 2 and out["eval_subset"]["task_ids"] == ["a", "b"]
  out = loop._finish({"before_rl": b, "after_rl": dict(b, pass_at_1=0.35, pass_at_1_ci95=[0.15, 0.5])}, c, ev)
  assert not out["improved_outside_cis"]  # 0.2 lies inside the after-RL interval


def test_paired_delta_interval_sees_a_gain_the_separate_intervals_cannot():
  # 168 tasks; 24 pass before, the same 24 and 6 more after: the separate 95% intervals
  # overlap (no "outside both"), but each task pairs with itself and the change is all gain.
  c = tiny_cpu.get_config()
  ev = [_T(f"t{i}") for i in range(168)]
  before = [_R(t.id, i < 24, float(i < 24)) for i, t in enumerate(ev)]
  after = [_R(t.id, i < 30, float(i < 30)) for i, t in enumerate(ev)]
  b = loop.summarize_eval(before, ev, 2000)
  a = loop.summarize_eval(after, ev, 2000)
  out = loop._finish({"before_rl": b, "after_rl": a}, c, ev)
  lo, hi = out["delta_pass_at_1_ci95"]
  assert not out["improved_outside_cis"]
  assert out["delta_pass_at_1"] == pytest.approx(6 / 168)
  assert 0.0 < lo <= out["delta_pass_at_1"] <= hi
  assert hi - lo < 0.6 * (b["pass_at_1_ci95"][1] - b["pass_at_1_ci95"][0])
  # Outcomes that only trade places (as many lost as gained) give an interval around zero.
  swapped = [_R(t.id, 6 <= i < 30, float(6 <= i < 30)) for i, t in enumerate(ev)]
  lo, hi = loop._finish({"before_rl": b, "after_rl": loop.summarize_eval(swapped, ev, 2000)},
                        c, ev)["delta_pass_at_1_ci95"]
  assert lo < 0.0 < hi


def test_eval_temperature_defaults_to_the_training_temperature_and_is_recorded():
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.loop.eval_temperature = -1.0
    c.rl.temperature = 0.7
  assert loop._eval_temperature(c) == pytest.approx(0.7)
  with c.unlocked():
    c.loop.eval_temperature = 0.0
  assert loop._eval_temperature(c) == 0.0
  assert loop._finish({}, c, [_T("a")])["eval_subset"]["temperature"] == 0.0


def test_tiny_gpu_config_is_the_tiny_model_with_a_larger_batch_that_splits():
  from configs import tiny_gpu
  g, c = tiny_gpu.get_config(), tiny_cpu.get_config()
  loop.check_batch_shape(g)
  assert g.model.to_dict() == c.model.to_dict() and g.train.init_from == c.train.init_from
  assert g.train.prompts_per_step * g.train.samples_per_prompt == 16 * (
      c.train.prompts_per_step * c.train.samples_per_prompt)
  with pytest.raises(ValueError, match="takes no argument"):
    tiny_gpu.get_config("base")


def test_batch_that_does_not_split_into_micro_batches_is_a_clear_error():
  c = tiny_cpu.get_config()
  loop.check_batch_shape(c)                       # the default splits
  c.train.prompts_per_step, c.train.samples_per_prompt = 1, 2
  with pytest.raises(ValueError, match="train.micro_batches"):
    loop.check_batch_shape(c)


def test_a_training_row_shorter_than_the_context_is_a_clear_error():
  c = tiny_cpu.get_config()
  c.train.seq_len = c.train.max_context - 1
  with pytest.raises(ValueError, match="train.seq_len=2559 < train.max_context=2560"):
    loop.check_batch_shape(c)


def _episode(group, sample, reward, outcome="ok"):
  from envs.harness.world import EpisodeResult
  return EpisodeResult(task_id=f"t{group}", group_id=group, sample_index=sample, outcome=outcome,
                       tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1],
                       rollout_logprobs=[0.0, 0.0, -1.0, -1.0], prompt_len=2, reward=reward,
                       passed=reward == 1.0)


def test_dynamic_sampling_keeps_groups_with_signal_first_and_renumbers_them():
  c = tiny_cpu.get_config()
  rewards = {10: (1, 1), 11: (0, 1), 12: (0, 0), 13: (1, 0), 14: (0, 1)}   # 11, 13, 14 split
  results = [_episode(g, k, float(r)) for g, rs in rewards.items() for k, r in enumerate(rs)]
  assert loop.informative_groups(results, c) == [11, 13, 14]
  live = loop.informative_groups(results, c)
  picked = loop.pick_groups(results, live, 2)
  assert [r.task_id for r in picked] == ["t11", "t11", "t13", "t13"]
  assert [r.group_id for r in picked] == [0, 0, 1, 1]
  # Too few with signal: filled with the first groups without, so the batch keeps its shape.
  picked = loop.pick_groups(results, live, 4)
  assert [r.task_id for r in picked][::2] == ["t11", "t13", "t14", "t10"]
  batch, m = loop.rl_batch(picked, c)
  assert m["train/live_rows"] == 6.0
  with pytest.raises(ValueError, match="5 groups drawn, 6 needed"):
    loop.pick_groups(results, live, 6)


def test_a_steps_rows_pad_to_the_shortest_bucket_that_holds_its_longest_trajectory():
  c = tiny_cpu.get_config()
  c.train.seq_buckets = (8, 1024)
  short = [_episode(0, 0, 1.0), _episode(0, 1, 0.0)]
  assert loop.rl_batch(short, c)[0]["tokens"].shape == (2, 8)
  longer = short + [dataclasses.replace(_episode(1, 0, 1.0), tokens=list(range(9)),
                                        loss_mask=[0] * 2 + [1] * 7,
                                        rollout_logprobs=[0.0] * 9)]
  assert loop.rl_batch(longer, c)[0]["tokens"].shape == (3, 1024)
  assert loop.row_length(c, 2000) == c.train.seq_len == 2560   # past every bucket
  loop.check_batch_shape(c)
  c.train.seq_buckets = (8, 4096)
  with pytest.raises(ValueError, match=r"train.seq_buckets \(8, 4096\): \[4096\] not in"):
    loop.check_batch_shape(c)


def test_a_group_masked_for_timeouts_carries_no_signal_for_dynamic_sampling():
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.harness.max_timeouts_per_group = 0
  results = [_episode(0, 0, 1.0), _episode(0, 1, 0.0, outcome="tool_timeout"),
             _episode(1, 0, 1.0), _episode(1, 1, 0.0)]
  assert loop.informative_groups(results, c) == [1]


def test_launch_writes_compiled_programs_to_the_persistent_cache(tmp_path):
  import subprocess
  cache = tmp_path / "jax_cache"
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), "--mode=model",
                        "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"),
                        f"--config.workdir={tmp_path}", f"--config.jax_cache_dir={cache}",
                        "--config.jax_cache_min_compile_s=0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "scored a batch" in out.stdout
  assert cache.is_dir() and any(cache.iterdir())
