"""benchmarks/accelerator.py (behind accelerator.sh): the ~1B config, the GPU table, the FLOP
count and the decode roofline; a parent that starts no jax backend and children that set their
own memory policy; the script's CPU smoke run in bfloat16 (slow)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import accelerator  # noqa: E402
import device_memory  # noqa: E402
from configs import base  # noqa: E402
from models import presets  # noqa: E402
from models import qwen3_5  # noqa: E402

# A platform jax does not know: in a process with JAX_PLATFORMS set to it, starting any backend
# (a device query, an array, a concrete PRNG key, a compile) raises instead of taking the GPU.
NO_BACKEND = "no_backend_in_this_process"

# The parent's whole path (parameter counts, FLOPs, roofline, the JSON) with stand-in children
# whose figures are fixed; writes the result and the children's commands to argv[1].
PARENT = r"""
import json, sys
import accelerator
from models import qwen3_5

calls, timeouts = {}, {}
def child(name, cmd, timeout, env, log_dir):
  calls[name], timeouts[name] = cmd, timeout
  x = 2.0 if name.endswith("_versus") else 1.0      # --versus' runs: twice the tokens/s
  return {"model_step": {"jax_tokens_per_s": 1e4 * x, "peak_bytes_in_use": 5 * 2**30},
          "train_step": {"tokens_per_s": 1e4 * x, "peak_bytes_in_use": 7 * 2**30},
          "decode": {"engine_tokens_per_s": {"8": 1e3 * x, "32": 3e3 * x},
                     "peak_bytes_in_use": None}}[name.replace("_versus", "")], 1.0
counts = qwen3_5.count_params(accelerator.model_config(accelerator.SIZES["1b"]))
result = accelerator.main(sys.argv[2:], run_child=child)
json.dump({"result": result, "calls": calls, "timeouts": timeouts, "counts": counts},
          open(sys.argv[1], "w"))
"""


def _parent(tmp_path, *args):
  """Runs PARENT in a process where starting a jax backend fails; returns what it wrote."""
  env = dict(os.environ, JAX_PLATFORMS=NO_BACKEND)
  out = tmp_path / "parent.json"
  p = subprocess.run([sys.executable, "-c", PARENT, str(out), f"--out={tmp_path}", *args],
                     cwd=os.path.join(ROOT, "benchmarks"), env=env, capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
  return json.load(open(out))


def test_the_1b_config_has_about_1b_params_and_an_eighth_active():
  counts = qwen3_5.count_params(accelerator.model_config(accelerator.SIZES["1b"]))
  assert 0.9e9 < counts["total"] < 1.2e9, counts
  assert 6 < counts["total"] / counts["active"] < 10, counts


def test_gpu_table_matches_nvidia_smi_names_most_specific_first():
  assert accelerator.gpu_figures("NVIDIA H200") == (989e12, 4.8e12)
  assert accelerator.gpu_figures("NVIDIA H100 PCIe")[1] == 2.0e12
  assert accelerator.gpu_figures("NVIDIA H100 80GB HBM3")[1] == 3.35e12
  assert accelerator.gpu_figures("NVIDIA A100-SXM4-40GB")[1] == 1.555e12
  assert accelerator.gpu_figures("NVIDIA GeForce RTX 3090") is None


def test_flops_per_token_is_six_times_active_params_plus_attention():
  cfg = accelerator.model_config(accelerator.SIZES["1b"])
  active = qwen3_5.count_params(cfg)["active"]
  short, long = accelerator.flops_per_token(cfg, 16), accelerator.flops_per_token(cfg, 4096)
  assert 6 * active < short < 6.01 * active   # attention's share is negligible at 16 tokens
  n_attn = sum(1 for t in cfg.layer_types if t == "full_attention")
  attention = 3 * n_attn * 2 * 4096 * cfg.num_attention_heads * cfg.head_dim
  assert long == pytest.approx(6 * active + attention, rel=1e-9)


def test_decode_roofline_reads_active_weights_alone_and_all_experts_at_large_batches():
  cfg = accelerator.model_config(accelerator.SIZES["1b"])
  counts = qwen3_5.count_params(cfg)
  one = accelerator.decode_bytes_per_step(cfg, 1, context=0.0)
  # One token, no context: the active weights less the embedding lookup, and the GDN states.
  n_lin = sum(1 for t in cfg.layer_types if t == "linear_attention")
  state = n_lin * (cfg.linear_num_value_heads * cfg.linear_key_head_dim
                   * cfg.linear_value_head_dim * 4
                   + (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * 2)
  assert one == pytest.approx(2 * counts["active"] + state, rel=1e-9)
  # Thousands of tokens hit every expert: all weights but the embedding.
  many = accelerator.decode_bytes_per_step(cfg, 4096, context=0.0)
  assert many == pytest.approx(2 * (counts["total"] - counts["embedding"]) + 4096 * state,
                               rel=1e-6)
  # The KV cache grows the bytes linearly in context; tokens/s = batch x bandwidth / bytes.
  more = accelerator.decode_bytes_per_step(cfg, 8, context=1000.0)
  less = accelerator.decode_bytes_per_step(cfg, 8, context=500.0)
  n_full = sum(1 for t in cfg.layer_types if t == "full_attention")
  assert more - less == pytest.approx(8 * n_full * 2 * 500 * cfg.num_key_value_heads
                                      * cfg.head_dim * 2, rel=1e-9)
  assert accelerator.roofline_tokens_per_s(cfg, 8, 1000.0, 4.8e12) == pytest.approx(
      8 * 4.8e12 / more)


def test_count_params_and_the_parent_start_no_jax_backend_so_the_gpu_is_the_childrens(tmp_path):
  """The parent counts the 1B config's parameters and does all its arithmetic where starting a
  backend raises (so no device buffer is ever made: no backend, no buffer); each child's
  figures reach the JSON, its peak memory among them."""
  got = _parent(tmp_path, "--gpu_name=NVIDIA H200")
  want = qwen3_5.count_params(accelerator.model_config(accelerator.SIZES["1b"]))
  assert got["counts"] == want and got["result"]["params"] == want["total"]
  result = got["result"]
  assert result["model_step"]["mfu"] > 0 and result["train_step"]["mfu"] > 0
  assert set(result["decode"]["roofline"]) == {"8", "32"}
  assert result["model_step"]["peak_bytes_in_use"] == 5 * 2**30
  assert result["train_step"]["peak_bytes_in_use"] == 7 * 2**30
  assert result["decode"]["peak_bytes_in_use"] is None


def test_a_backend_started_under_the_guard_fails_so_the_parent_check_can_fail(tmp_path):
  """What the check above rests on: a concrete PRNG key (count_params' key before it was made
  inside jax.eval_shape) in a process with JAX_PLATFORMS=NO_BACKEND raises."""
  env = dict(os.environ, JAX_PLATFORMS=NO_BACKEND)
  p = subprocess.run([sys.executable, "-c", "import jax; jax.random.key(0)"], env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode != 0 and "Unable to initialize backend" in p.stderr, p.stderr[-2000:]


def test_the_smoke_run_gives_its_children_bfloat16_params_and_compute(tmp_path):
  """The CPU smoke run's children run the dtype the GPU runs (the parent, again, where no
  backend may start)."""
  got = _parent(tmp_path, "--smoke")
  assert got["result"]["dtype"] == "bfloat16" and got["result"]["smoke"]
  calls = got["calls"]
  assert "--dtype=bfloat16" in calls["model_step"] and "--dtype=bfloat16" in calls["decode"]
  for flag in ("--config.model.param_dtype=bfloat16", "--config.model.dtype=bfloat16"):
    assert flag in calls["train_step"]
  for flag in ("--set=model.param_dtype=bfloat16", "--set=model.dtype=bfloat16"):
    assert flag in calls["decode"]


def test_the_memory_policy_grows_on_demand_unless_the_environment_sets_one(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  assert device_memory.set_policy() == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
  assert device_memory.set_policy() == {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}


# Runs a benchmark script as a program (`--help`: it parses its flags and exits) with
# device_memory.set_policy recording whether jax was loaded when it ran.
CHILD = r"""
import os, runpy, sys
import device_memory
seen = []
policy = device_memory.set_policy
device_memory.set_policy = lambda: seen.append("jax" in sys.modules) or policy()
sys.argv = [sys.argv[1], "--help"]
try:
  runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
  pass
print("RESULT", seen, os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"))
"""


@pytest.mark.parametrize("script", ["model_step.py", "train_step.py", "decode.py"])
def test_each_child_sets_its_memory_policy_before_jax_loads(script):
  env = dict(os.environ, JAX_PLATFORMS=NO_BACKEND)
  env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
  p = subprocess.run([sys.executable, "-c", CHILD, script], cwd=os.path.join(ROOT, "benchmarks"),
                     env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-2000:]
  assert "RESULT [False] false" in p.stdout, p.stdout[-2000:]


@pytest.mark.slow
def test_smoke_run_in_bfloat16_writes_every_figure_and_each_childs_peak_memory(tmp_path):
  """accelerator.sh's CPU smoke run end to end, its parent where no backend may start (the
  children get JAX_PLATFORMS=cpu); bfloat16 params and compute on one device, as on the GPU
  (not the 8 host devices tests/conftest.py gives this process: the smoke step's 4 rows do not
  split over 8)."""
  env = dict(os.environ, ACCEL_SMOKE="1", OUT=str(tmp_path), PYTHON=sys.executable,
             JAX_PLATFORMS=NO_BACKEND)
  env.pop("XLA_FLAGS", None)
  p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "accelerator.sh")], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=1800)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
  out = json.load(open(tmp_path / "accelerator.json"))
  assert out["smoke"] and out["gpu"] == "NVIDIA H200" and out["dtype"] == "bfloat16"
  assert out["train_step"]["dtype"] == out["train_step"]["param_dtype"] == "bfloat16"
  for name in ("model_step", "train_step", "decode"):
    assert out[name]["dtype"] == "bfloat16", name
    assert out[name]["peak_bytes_in_use"] is None, name   # the CPU keeps no statistics
  assert out["model_step"]["jax_tokens_per_s"] > 0 and out["model_step"]["mfu"] > 0
  assert out["train_step"]["tokens_per_s"] > 0 and out["train_step"]["mfu"] > 0
  for c in ("2", "4"):
    r = out["decode"]["roofline"][c]
    assert r["tokens_per_s"] > 0 and 0 < r["of_roofline"] == pytest.approx(
        r["tokens_per_s"] / r["roofline_tokens_per_s"])


def test_the_train_step_child_trains_every_weight_as_a_gpu_recipe_does(tmp_path):
  """tiny_cpu.py trains the output norm alone; the benchmark's step updates every weight."""
  calls = _parent(tmp_path, "--smoke")["calls"]
  assert calls["train_step"].count("--config.optim.trainable=") == 1
  assert not any(a.startswith("--config.optim.trainable=") and a != "--config.optim.trainable="
                 for a in calls["train_step"])


def test_a_model_setting_reaches_every_child_and_the_json(tmp_path):
  """--set=model.KEY=VALUE (e.g. the Gated DeltaNet's walk) is what all three parts run, and
  the figures record it; a malformed one is an error naming the flag."""
  got = _parent(tmp_path, "--smoke", "--set=model.gdn_scan=fused")
  calls = got["calls"]
  assert "--set=model.gdn_scan=fused" in calls["model_step"]
  assert "--config.model.gdn_scan=fused" in calls["train_step"]
  assert "--set=model.gdn_scan=fused" in calls["decode"]
  assert got["result"]["settings"] == {"gdn_scan": "fused"}
  with pytest.raises(SystemExit, match="--set takes model.KEY=VALUE"):
    accelerator.main(["--smoke", "--set=gdn_scan=fused"], run_child=lambda *a: None)


def test_an_engine_setting_reaches_decode_alone(tmp_path):
  """--set=rollout.KEY=VALUE (the engine's, e.g. its weights layer by layer) is decode's
  alone: the model and train steps run no engine; --versus takes one too."""
  got = _parent(tmp_path, "--smoke", "--set=rollout.scan_layers=False",
                "--versus=rollout.max_slots=64")
  calls = got["calls"]
  assert "--set=rollout.scan_layers=False" in calls["decode"]
  assert "--set=rollout.scan_layers=False" in calls["decode_versus"]
  assert "--set=rollout.max_slots=64" in calls["decode_versus"]
  assert "--set=rollout.max_slots=64" not in calls["decode"]
  for part in ("model_step", "train_step", "model_step_versus", "train_step_versus"):
    assert not any("rollout" in a for a in calls[part]), calls[part]
  assert got["result"]["settings"] == {"rollout.scan_layers": "False"}
  assert got["result"]["versus"]["settings"] == {"rollout.max_slots": "64"}
  with pytest.raises(SystemExit, match="rollout.KEY=VALUE or train.KEY=VALUE"):
    accelerator.main(["--smoke", "--set=optim.lr=8"], run_child=lambda *a: None)


def test_a_train_setting_reaches_the_train_step_alone(tmp_path):
  """--versus=train.micro_batches=2 (fewer, larger micro-batches): the train step's second
  run has it in place of the size's, given once; the model step and decode never see it."""
  got = _parent(tmp_path, "--smoke", "--versus=train.micro_batches=2")
  calls = got["calls"]
  micro = lambda part: [a for a in calls[part] if a.startswith("--config.train.micro_batches")]
  assert micro("train_step") == ["--config.train.micro_batches=1"]   # the smoke size's
  assert micro("train_step_versus") == ["--config.train.micro_batches=2"]
  for part in ("model_step", "decode", "model_step_versus", "decode_versus"):
    assert not any("micro_batches" in a for a in calls[part]), calls[part]
  assert got["result"]["versus"]["settings"] == {"train.micro_batches": "2"}


def test_a_long_decode_prompt_reaches_the_decode_child_and_its_roofline(tmp_path):
  """--decode_prompt_len: the decode child's prompts, and the roofline's context, are that
  long (the cache the fused decode attention reads in place); the JSON records it."""
  short = _parent(tmp_path, "--gpu_name=NVIDIA H200")
  long = _parent(tmp_path, "--gpu_name=NVIDIA H200", "--decode_prompt_len=8192")
  assert "--prompt_len=8192" in long["calls"]["decode"]
  assert "--prompt_len=256" in short["calls"]["decode"]
  assert long["result"]["decode_prompt_len"] == 8192
  roof = lambda r: r["result"]["decode"]["roofline"]["8"]["roofline_tokens_per_s"]
  assert roof(long) < roof(short)


def test_decode_samples_at_the_temperature_asked_for_and_is_greedy_by_default(tmp_path):
  """--decode_temperature: the decode child's requests sample at it (RL rollouts' temperature
  1 draws over the vocabulary every token); greedy by default; the JSON records it."""
  greedy = _parent(tmp_path, "--gpu_name=NVIDIA H200")
  sampled = _parent(tmp_path, "--gpu_name=NVIDIA H200", "--decode_temperature=1")
  assert "--temperature=0.0" in greedy["calls"]["decode"]
  assert "--temperature=1.0" in sampled["calls"]["decode"]
  assert (greedy["result"]["decode_temperature"], sampled["result"]["decode_temperature"]) == (0, 1)


def test_the_a3b_slice_is_one_layer_cycle_of_35b_a3b_at_its_widths(tmp_path):
  """--size=a3b_slice: every width of the 35B-A3B preset (256 experts top-8, the 248k
  vocabulary, 16/32 Gated DeltaNet heads) with 4 layers (3 Gated DeltaNet, 1 attention), the
  widths each child is given, and the size's longer time limit."""
  cfg = accelerator.model_config(accelerator.SIZES["a3b_slice"])
  m = base.get_model_config()
  m.update(presets.preset("qwen3_5_35b_a3b"), num_hidden_layers=4, param_dtype="bfloat16",
           dtype="bfloat16")
  assert cfg == qwen3_5.config_from_dict(m)
  assert list(cfg.layer_types).count("linear_attention") == 3 and len(cfg.layer_types) == 4
  counts = qwen3_5.count_params(cfg)
  assert 4e9 < counts["total"] < 5e9 and counts["active"] < counts["total"] / 3, counts
  got = _parent(tmp_path, "--gpu_name=NVIDIA H200", "--size=a3b_slice")
  calls, result = got["calls"], got["result"]
  assert result["size"] == "a3b_slice" and result["params"] == counts["total"]
  assert {"--hidden=2048", "--experts=256", "--topk=8", "--vocab=248320",
          "--set=model.linear_num_value_heads=32"} <= set(calls["model_step"])
  assert "--config.model.linear_num_key_heads=16" in calls["train_step"]
  assert "--config.model.num_hidden_layers=4" in calls["train_step"]
  assert "--set=model.num_experts=256" in calls["decode"]
  assert got["timeouts"] == {"model_step": 300, "train_step": 300, "decode": 600}
  assert _parent(tmp_path, "--gpu_name=NVIDIA H200")["timeouts"]["model_step"] == 100


def test_versus_runs_every_part_again_with_its_settings_and_reports_the_ratios(tmp_path):
  """--versus=model.KEY=VALUE: each part runs twice in the same run, the second time with the
  setting on top of --set's; the JSON holds both and each part's tokens/s ratio (here the
  stand-in children report twice the tokens/s with it)."""
  got = _parent(tmp_path, "--gpu_name=NVIDIA H200", "--set=model.gdn_scan=fused",
                "--versus=model.gdn_decode=fused")
  calls, result = got["calls"], got["result"]
  for part in ("model_step", "train_step", "decode"):
    flag = "--config.model.gdn_decode=fused" if part == "train_step" else "--set=model.gdn_decode=fused"
    assert flag not in calls[part] and flag in calls[part + "_versus"]
    keep = flag.replace("gdn_decode", "gdn_scan")
    assert keep in calls[part] and keep in calls[part + "_versus"]
  versus = result["versus"]
  assert versus["settings"] == {"gdn_decode": "fused"}
  assert versus["ratios"]["model_step"] == versus["ratios"]["train_step"] == 2.0
  assert versus["ratios"]["decode"] == {"8": 2.0, "32": 2.0}
  assert versus["train_step"]["mfu"] == pytest.approx(2 * result["train_step"]["mfu"])
  assert "versus" not in _parent(tmp_path, "--gpu_name=NVIDIA H200")["result"]
