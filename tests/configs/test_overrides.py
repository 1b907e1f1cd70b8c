"""Every override takes effect: presets are defaults, derived values follow their source, and
every key of every sweep file and a sample of each full-size config's keys changes what the
config resolves to (for model keys: the model, and for its shapes the parameters' shapes).

Configs are resolved as launch.py resolves them: the config file's `get_config()`, locked,
then `--config.<key>=<value>` flags parsed by ml_collections (`_resolve`).
"""
import copy
import functools
import os
import pickle

from absl import flags
import jax
from ml_collections import config_flags
import pytest

from configs import base
from configs import record
from models import config as model_config
from models import presets
from models import qwen3_5
from rl import plan
from rl import sweep
from rl.rollout import capacity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FULL_SIZE = ("configs/qwen3_5_35b_a3b.py", "configs/qwen3_5_397b_a17b.py")
SWEEPS = sorted(f"configs/sweeps/{f}" for f in os.listdir(os.path.join(ROOT, "configs", "sweeps"))
                if f.endswith(".py") and not f.startswith("_"))


def _resolve(config_file: str, *args: str):
  """The config launch.py runs with: `config_file` locked, then the `--config...` flags in
  `args` (others ignored), parsed by ml_collections' config flag."""
  argv = ["launch.py"] + [a for a in args if a.startswith("--config")]
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", os.path.join(ROOT, config_file),
                                           flag_values=fv, lock_config=True, sys_argv=argv)
  fv(argv)
  return holder.value


def _set(config_file: str, **overrides):
  """`_resolve` with `--config.<key>=<value>` flags (keys with __ for dots), values written as
  a sweep's job writes them."""
  return _resolve(config_file, *(f"--config.{k.replace('__', '.')}={record.value_text(v)}"
                                 for k, v in overrides.items()))


def _model(c):
  return qwen3_5.config_from_dict(c.model)


@functools.lru_cache(maxsize=None)
def _shapes(m):
  """The model's parameters, from shapes only: every leaf's (path, shape, dtype), and the
  total and active counts."""
  tree = jax.eval_shape(functools.partial(qwen3_5.init_params, m), jax.random.key(0))
  leaves = tuple((jax.tree_util.keystr(p), s.shape, str(s.dtype))
                 for p, s in jax.tree_util.tree_flatten_with_path(tree)[0])
  counts = qwen3_5.count_params(m)
  return leaves, counts["total"], counts["active"]


# -- presets are defaults ---------------------------------------------------------------------

def test_a_depth_set_on_the_command_line_builds_that_depth_over_the_preset():
  full = _model(_resolve("configs/qwen3_5_35b_a3b.py"))
  c = _set("configs/qwen3_5_35b_a3b.py", model__num_hidden_layers=4)
  m = _model(c)
  assert c.model.preset == "qwen3_5_35b_a3b" and m.num_hidden_layers == 4
  assert m.hidden_size == full.hidden_size and m.num_experts == full.num_experts
  # The layers hold a tenth of their parameters; the embedding and the LM head stay whole.
  outside = qwen3_5.count_params(full)["embedding"] * 2
  layers_4, layers_40 = (qwen3_5.count_params(x)["total"] - outside for x in (m, full))
  assert layers_4 == pytest.approx(layers_40 / 10, rel=1e-3)


@pytest.mark.parametrize("order", ["preset first", "field first"])
def test_a_field_set_keeps_its_value_whatever_the_preset_and_the_others_follow_it(order):
  args = ["--config.model.preset=qwen3_5_397b_a17b", "--config.model.hidden_size=1024"]
  c = _resolve("configs/qwen3_5_35b_a3b.py", *(args if order == "preset first" else args[::-1]))
  m = _model(c)
  big = presets.preset("qwen3_5_397b_a17b")
  assert m.hidden_size == 1024
  assert (m.num_hidden_layers, m.num_experts, m.num_attention_heads) == (
      big["num_hidden_layers"], big["num_experts"], big["num_attention_heads"])


def test_a_preset_named_on_a_tiny_config_fills_the_fields_that_config_did_not_set():
  m = _model(_set("configs/tiny_cpu.py", model__preset="qwen3_5_35b_a3b"))
  p = presets.preset("qwen3_5_35b_a3b")
  assert (m.num_hidden_layers, m.hidden_size, m.vocab_size) == (
      p["num_hidden_layers"], p["hidden_size"], p["vocab_size"])
  # tiny_cpu.py sets these two itself: they keep its values.
  assert m.tie_word_embeddings is True and m.partial_rotary_factor == 1.0


def test_resolving_the_model_reads_its_fields_and_never_the_preset_name():
  fields = base.get_model_config().to_dict()
  fields["preset"] = "qwen3_5_397b_a17b"
  assert model_config.from_config_dict(fields).hidden_size == fields["hidden_size"] == 64


# -- derived values follow their source --------------------------------------------------------

def test_the_engine_length_and_kept_turns_follow_their_sources_on_a_full_size_config():
  c = _set("configs/qwen3_5_35b_a3b.py", train__max_context=4096, train__prompts_per_step=4)
  assert c.rollout.max_len == 4096
  assert c.rollout.turn_cache == 4 * c.train.samples_per_prompt
  assert c.train.seq_len == 163_840          # set by the recipe itself: it keeps its value
  assert capacity.plan_from_config(c, 16).context_len == 4096


@pytest.mark.parametrize("order", ["source first", "derived first"])
def test_setting_a_derived_key_wins_over_its_source_and_leaves_the_source_alone(order):
  args = ["--config.train.max_context=4096", "--config.rollout.max_len=8192",
          "--config.train.prompts_per_step=4", "--config.rollout.turn_cache=3"]
  c = _resolve("configs/qwen3_5_35b_a3b.py", *(args if order == "source first" else args[::-1]))
  assert (c.rollout.max_len, c.train.max_context) == (8192, 4096)
  assert (c.rollout.turn_cache, c.train.prompts_per_step) == (3, 4)


def test_the_tiny_configs_row_and_slot_follow_its_context():
  for name in ("configs/tiny_cpu.py", "configs/tiny_gpu.py"):
    c = _set(name, train__max_context=1024)
    assert c.train.seq_len == c.rollout.max_len == 1024, name


def test_references_survive_copies_pickles_and_resolution():
  c = _resolve("configs/qwen3_5_35b_a3b.py")
  for other in (copy.deepcopy(c), pickle.loads(pickle.dumps(c))):
    other.train.max_context = 1000
    other.model.num_hidden_layers = 8
    other.model.preset = "qwen3_5_397b_a17b"
    assert (other.rollout.max_len, other.model.num_hidden_layers, other.model.hidden_size) == (
        1000, 8, 4096)
  assert c.rollout.max_len == 160_000 and c.model.hidden_size == 2048   # the copies only
  plain = c.copy_and_resolve_references()
  assert plain.to_dict() == c.to_dict()
  with plain.unlocked():
    plain.train.max_context = 1000
  assert plain.rollout.max_len == 160_000     # resolved: a plain value now


def test_the_plan_follows_depth_and_context_overrides():
  c = _set("configs/qwen3_5_35b_a3b.py", model__num_hidden_layers=4, train__max_context=4096)
  p = plan.memory_plan(c, c.plan.num_devices, [4096])
  assert p["counts"] == qwen3_5.count_params(_model(c))
  assert "max_len 4096" in plan.format_rollout_plan(c, c.plan.num_devices)


# -- a test that cannot be fooled --------------------------------------------------------------

def _same(a, b) -> bool:
  """Equal values (tuples and lists alike; a bool is not the number 1)."""
  if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  return a == b and isinstance(a, bool) == isinstance(b, bool)


def _model_changes(key: str, before, after, failures: list) -> None:
  """A model key: the resolved model must change; a shape key its parameters too."""
  field = key.split(".", 1)[1]
  m0, m1 = _model(before), _model(after)
  if m0 == m1:
    failures.append(f"{key}: the resolved model is unchanged")
  elif field not in _SHAPELESS and _shapes(m0) == _shapes(m1):
    failures.append(f"{key}: the model's parameter shapes and counts are unchanged")


# Model fields that say how the model computes, not what its parameters are: overriding one
# must change the resolved model, not its parameters.
_SHAPELESS = {"rope_theta", "partial_rotary_factor", "rms_norm_eps", "norm_topk_prob",
              "max_position_embeddings", "initializer_range", "dtype", "remat",
              "attention_query_chunk", "attention_causal_block", "logits_chunk", "gdn_chunk_size",
              "gdn_backward", "scan_unroll", "attention_impl", "moe_dispatch", "moe_block_size",
              "moe_block_chunk", "gdn_scan"}


@pytest.mark.parametrize("config_file", ["configs/tiny_cpu.py"] + list(FULL_SIZE))
@pytest.mark.parametrize("sweep_file", SWEEPS)
def test_every_key_of_a_sweep_changes_the_config_its_jobs_resolve_to(sweep_file, config_file):
  argv = ["launch.py", f"--config={os.path.join(ROOT, config_file)}", "--mode=rl"]
  parent = _resolve(config_file)
  jobs = sweep.load_sweep(os.path.join(ROOT, sweep_file))
  cmds = sweep.job_commands(parent, jobs, argv)
  resolved = [(name, job, _resolve(config_file, *args[2:])) for name, job, args in cmds]
  failures, changed = [], set()
  for name, job, c in resolved:
    flat, before = record.flat(c), record.flat(parent)
    for key, value in job.items():
      if key == "name":
        continue
      if not _same(flat[key], value):
        failures.append(f"{name}: {key} resolved to {flat[key]!r}, the job sets {value!r}")
      if flat[key] != before[key]:
        changed.add(key)
        if key.startswith("model."):
          _model_changes(key, parent, c, failures)
  keys = {k for job in jobs for k in job if k != "name"}
  failures += [f"{k}: no job of {sweep_file} changes the resolved config"
               for k in sorted(keys - changed)]
  # No two arms run the same config.
  flats = [{k: repr(v) for k, v in record.flat(c).items() if k != "name"} for _, _, c in resolved]
  failures += [f"{resolved[i][0]} and {resolved[j][0]} resolve to the same config"
               for i in range(len(flats)) for j in range(i) if flats[i] == flats[j]]
  assert not failures, "\n".join(failures)


def _another(key: str, value, c):
  """A value of `key` other than `value`, valid where the model checks it."""
  field = key.split(".")[-1]
  if key == "model.preset":
    return next(p for p in sorted(presets.PRESETS) if p != value)
  if key == "model.layer_types":
    n = c.model.num_hidden_layers
    return tuple(model_config.FULL if i % 2 else model_config.LINEAR for i in range(n))
  if field in ("dtype", "param_dtype"):
    return "float32" if value == "bfloat16" else "bfloat16"
  if key == "model.remat":
    return "none" if value == "full" else "full"
  if isinstance(value, bool):
    return not value
  if isinstance(value, int):
    return value * 2 if value > 0 else value + 1
  if isinstance(value, float):
    return value * 2 if value else 0.5
  if isinstance(value, str):
    return value + "_x"
  if isinstance(value, tuple):
    return value[:-1] if value else (1,)
  raise TypeError(f"{key}: no other value for {value!r}")


def _sample(config_file: str) -> list:
  """The keys a full-size config sets over configs/base.py, every field a preset names, and the
  sources of derived values."""
  c = _resolve(config_file)
  keys = {k for k, _, _ in record.differences(c)}
  keys |= {f"model.{f}" for f in presets.FIELDS}
  keys |= {"train.max_context", "train.prompts_per_step", "train.samples_per_prompt"}
  return sorted(keys)


@pytest.mark.parametrize("config_file", FULL_SIZE)
def test_every_sampled_key_of_a_full_size_config_changes_what_it_resolves_to(config_file):
  parent = _resolve(config_file)
  before = record.flat(parent)
  failures = []
  keys = _sample(config_file)
  assert len(keys) > 40 and "model.num_hidden_layers" in keys and "rollout.max_len" in keys
  for key in keys:
    new = _another(key, before[key], parent)
    flag = f"--config.{key}={record.value_text(new)}"
    c = _resolve(config_file, flag)
    after = record.flat(c)
    if not _same(after[key], new):
      failures.append(f"{key}: resolved to {after[key]!r} after {flag}")
    elif key.startswith("model."):
      _model_changes(key, parent, c, failures)
  assert not failures, "\n".join(failures)


def test_the_unfoolable_check_names_a_key_that_changes_nothing():
  """The check above fails on a key whose override is lost: here, the preset re-applied over
  the fields when the model is resolved (what presets did before they were defaults)."""
  parent = _resolve("configs/qwen3_5_35b_a3b.py")
  c = _set("configs/qwen3_5_35b_a3b.py", model__num_hidden_layers=4)
  with c.unlocked():
    c.model.num_hidden_layers = presets.preset("qwen3_5_35b_a3b")["num_hidden_layers"]
  failures = []
  _model_changes("model.num_hidden_layers", parent, c, failures)
  assert failures == ["model.num_hidden_layers: the resolved model is unchanged"]
