"""benchmarks/accelerator.py (behind accelerator.sh): the ~1B config, the GPU table, the FLOP
count and the decode roofline; the script's CPU smoke run (slow)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import accelerator  # noqa: E402
from models import qwen3_5  # noqa: E402


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


@pytest.mark.slow
def test_smoke_run_writes_every_figure(tmp_path):
  env = dict(os.environ, ACCEL_SMOKE="1", OUT=str(tmp_path), PYTHON=sys.executable)
  p = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "accelerator.sh")], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=1800)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
  out = json.load(open(tmp_path / "accelerator.json"))
  assert out["smoke"] and out["gpu"] == "NVIDIA H200"
  assert out["model_step"]["jax_tokens_per_s"] > 0 and out["model_step"]["mfu"] > 0
  assert out["train_step"]["tokens_per_s"] > 0 and out["train_step"]["mfu"] > 0
  for c in ("2", "4"):
    r = out["decode"]["roofline"][c]
    assert r["tokens_per_s"] > 0 and 0 < r["of_roofline"] == pytest.approx(
        r["tokens_per_s"] / r["roofline_tokens_per_s"])
