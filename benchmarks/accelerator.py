"""The accelerator benchmark behind benchmarks/accelerator.sh: model step, train step MFU and
decode against the HBM roofline, on one GPU, for a ~1B-parameter MoE (~1/8 of it active) or
(`--size=a3b_slice`) four layers of Qwen3.5-35B-A3B at its real widths.

  benchmarks/accelerator.sh                      # on a machine with an NVIDIA GPU
  benchmarks/accelerator.sh --size=a3b_slice     # the 35B-A3B slice (at most 300 s a part)
  benchmarks/accelerator.sh --versus=model.gdn_decode=fused   # each part again with a setting
  ACCEL_SMOKE=1 benchmarks/accelerator.sh        # tiny config on the CPU: the script's logic

Runs benchmarks/model_step.py (bfloat16, no torch), benchmarks/train_step.py and
benchmarks/decode.py (engine only, 8 / 32 / 128 sequences) as subprocesses on the same model
config, reads the JSON line each prints last, and writes one JSON of figures to
`<out>/accelerator.json`:

  model_step   forward+backward tokens/s of the jitted model
  train_step   GRPO step tokens/s and MFU = model FLOPs per token (6 x active params + the
               attention score/value matmuls, benchmarks/train_step.py) x tokens/s / the GPU's
               dense bf16 peak
  decode       engine tokens/s at each concurrency and its share of the HBM roofline: a decode
               step must read the weights its tokens touch (every dense weight, and of the routed
               experts those the batch's top-k picks hit: E (1 - (1 - k/E)^B) per layer in
               expectation for B tokens) plus each sequence's KV cache (attention layers, the
               tokens so far) and Gated DeltaNet state, so tokens/s <= B x bandwidth / bytes.

Peak FLOP/s and HBM bandwidth come from `GPUS`, keyed by a substring of
`nvidia-smi --query-gpu=name`.

Memory: this process never starts a jax backend (it counts parameters from shapes,
qwen3_5.count_params, and does the FLOP and roofline arithmetic in Python), so the GPU is the
children's alone; each child sets its own allocator policy before jax starts
(benchmarks/device_memory.py: XLA_PYTHON_CLIENT_PREALLOCATE=false unless the environment says
otherwise) and reports its peak from `jax.devices()[0].memory_stats()` as `peak_bytes_in_use`
(null on the CPU, which keeps no statistics).
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  (the version only: this process starts no backend)

from configs import base  # noqa: E402
from models import presets  # noqa: E402
from models import qwen3_5  # noqa: E402
from models.config import FULL, LINEAR  # noqa: E402

import train_step as train_bench  # noqa: E402  (a sibling: benchmarks/ is sys.path[0])

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# name substring -> (dense bf16 peak FLOP/s, HBM bytes/s), from the vendors' data sheets. The
# first match wins, so the more specific names come first.
GPUS = {
    "GB200": (2.5e15, 8.0e12),
    "B200": (2.25e15, 8.0e12),
    "H200": (989e12, 4.8e12),
    "H100 PCIe": (756e12, 2.0e12),
    "H100 NVL": (835e12, 3.9e12),
    "H100": (989e12, 3.35e12),
    "GH200": (989e12, 4.0e12),
    "A100-SXM4-40GB": (312e12, 1.555e12),
    "A100": (312e12, 2.039e12),
    "L40S": (362e12, 0.864e12),
    "L4": (121e12, 0.3e12),
    "A10G": (70e12, 0.6e12),
}

# The model: widths of a ~1B-parameter MoE with ~1/8 of it active (64 experts, top-2), in the
# flags of benchmarks/model_step.py; `smoke`: a tiny one for the CPU; `a3b_slice`: a preset's
# every width (models/presets.py) with fewer layers, here one layer cycle of 35B-A3B (3 Gated
# DeltaNet, 1 attention; 256 experts top-8, the 248k vocabulary): ~4.4 B parameters, whose
# GRPO step in bfloat16 fits one H200 (`--mode=compile` for h200:1x1: docs/results.md).
SIZES = {
    "1b": dict(hidden=1024, layers=12, heads=8, head_dim=128, experts=64, topk=2, moe_ffn=384,
               vocab=32768),
    "a3b_slice": dict(preset="qwen3_5_35b_a3b", layers=4),
    "smoke": dict(hidden=64, layers=4, heads=4, head_dim=16, experts=8, topk=2, moe_ffn=32,
                  vocab=1024),
}
# Batch shapes per size: model_step rows x tokens; train_step prompts x samples x tokens in
# micro-batches; decode prompt length, timed steps, concurrencies; seconds a benchmark may take
# (`--timeout` 0: this; decode twice).
RUNS = {
    "1b": dict(step_batch=8, step_seq=2048, prompts=8, samples=4, train_seq=2048, micro=4,
               prompt_len=256, decode_tokens=64, concurrency=(8, 32, 128), timeout=100),
    # 16 rows of 4,096 tokens in 4 micro-batches, as the 1b step's 32 rows of 2,048.
    "a3b_slice": dict(step_batch=4, step_seq=4096, prompts=4, samples=4, train_seq=4096,
                      micro=4, prompt_len=256, decode_tokens=64, concurrency=(8, 32, 128),
                      timeout=300),
    "smoke": dict(step_batch=2, step_seq=128, prompts=2, samples=2, train_seq=128, micro=1,
                  prompt_len=16, decode_tokens=4, concurrency=(2, 4), timeout=300),
}


def gpu_figures(name: str):
  """(peak bf16 FLOP/s, HBM bytes/s) of the GPU called `name`; None when it is not in GPUS."""
  for key, figures in GPUS.items():
    if key.lower() in name.lower():
      return figures
  return None


def model_overrides(size: dict, dtype: str) -> dict:
  """The model config keys of `size` (benchmarks/model_step.py's flags, or a preset's fields
  and a layer count) as config fields."""
  if "preset" in size:
    fields = {k: v for k, v in presets.preset(size["preset"]).items() if k != "layer_types"}
    return dict(fields, num_hidden_layers=size["layers"], param_dtype=dtype, dtype=dtype)
  h, heads, hd = size["hidden"], size["heads"], size["head_dim"]
  return dict(hidden_size=h, num_hidden_layers=size["layers"], vocab_size=size["vocab"],
              num_attention_heads=heads, num_key_value_heads=2, head_dim=hd,
              linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
              linear_key_head_dim=hd, linear_value_head_dim=hd,
              num_experts=size["experts"], num_experts_per_tok=size["topk"],
              moe_intermediate_size=size["moe_ffn"],
              shared_expert_intermediate_size=size["moe_ffn"],
              tie_word_embeddings=False, partial_rotary_factor=0.25,
              param_dtype=dtype, dtype=dtype)


def step_flags(fields: dict) -> dict:
  """benchmarks/model_step.py's size flags of the model `fields` (its `--set` gives the rest)."""
  keys = dict(hidden="hidden_size", layers="num_hidden_layers", heads="num_attention_heads",
              head_dim="head_dim", experts="num_experts", topk="num_experts_per_tok",
              moe_ffn="moe_intermediate_size", vocab="vocab_size")
  return {flag: fields[key] for flag, key in keys.items()}


def model_fields(size: dict, dtype: str = "bfloat16"):
  """The model config (a ConfigDict) of `size`: base defaults, then the size's fields."""
  m = base.get_model_config()
  m.update(model_overrides(size, dtype))
  return m


def model_config(size: dict, dtype: str = "bfloat16"):
  """The ModelConfig of `size` (base defaults otherwise)."""
  return qwen3_5.config_from_dict(model_fields(size, dtype))


def flops_per_token(cfg, seq: int) -> float:
  """Model FLOPs per trained token (forward + backward) of rows of `seq` tokens."""
  return train_bench.model_flops_per_step(cfg, 1, seq, 0) / seq


def decode_bytes_per_step(cfg, batch: int, context: float, weight_bytes: int = 2,
                          cache_bytes: int = 2) -> float:
  """HBM bytes one decode step of `batch` sequences of `context` tokens must read.

  Weights: every non-routed weight (the input embedding excluded: a row lookup) and, per MoE
  layer, the routed experts the batch's tokens hit, E (1 - (1 - k/E)^batch) in expectation.
  Cache: the keys and values of the attention layers over `context` tokens, the Gated DeltaNet
  states (float32) and conv windows.
  """
  counts = qwen3_5.count_params(cfg)
  dense = counts["total"] - counts["routed_experts"] - counts["embedding"]
  if cfg.tie_word_embeddings:
    dense += counts["embedding"]   # the LM head reads the whole table
  routed = counts["routed_experts"]
  if cfg.use_moe and routed:
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    routed *= 1.0 - (1.0 - k / e) ** batch
  weights = (dense + routed) * weight_bytes
  n_full = sum(1 for t in cfg.layer_types if t == FULL)
  n_lin = sum(1 for t in cfg.layer_types if t == LINEAR)
  kv = n_full * 2 * context * cfg.num_key_value_heads * cfg.head_dim * cache_bytes
  state = n_lin * (cfg.linear_num_value_heads * cfg.linear_key_head_dim
                   * cfg.linear_value_head_dim * 4
                   + (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim * cache_bytes)
  return weights + batch * (kv + state)


def roofline_tokens_per_s(cfg, batch: int, context: float, bandwidth: float, **kw) -> float:
  return batch * bandwidth / decode_bytes_per_step(cfg, batch, context, **kw)


def _last_json(text: str):
  for line in reversed(text.strip().splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  raise ValueError("no JSON line in the output")


def _run(name: str, cmd: list, timeout: float, env: dict, log_dir: str):
  """Runs one benchmark; returns (its JSON line, seconds) or ({"error": ...}, seconds)."""
  t0 = time.time()
  print(f"[{name}] {' '.join(cmd)}", flush=True)
  try:
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    with open(os.path.join(log_dir, f"{name}.log"), "w") as f:
      f.write(p.stdout + "\n--- stderr ---\n" + p.stderr)
    if p.returncode != 0:
      tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
      return {"error": f"exit {p.returncode}: " + " | ".join(tail)}, time.time() - t0
    return _last_json(p.stdout), time.time() - t0
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f} s"}, time.time() - t0
  except ValueError as e:
    return {"error": str(e)}, time.time() - t0


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default="runs/accelerator")
  ap.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
  ap.add_argument("--size", default="1b", choices=[k for k in SIZES if k != "smoke"],
                  help="the model: 1b, or a3b_slice (one layer cycle of 35B-A3B)")
  ap.add_argument("--gpu_name", default="", help="'' = nvidia-smi's; the smoke run's default "
                  "is NVIDIA H200 (its table entry, to exercise the maths)")
  ap.add_argument("--breakdown", action="store_true",
                  help="also time each model component alone (model_step.py --breakdown)")
  ap.add_argument("--set", action="append", default=[], metavar="model.KEY=VALUE",
                  help="a model config setting for every part (repeatable) that changes no "
                  "shape (the FLOPs and parameter counts are the size's), e.g. "
                  "model.gdn_scan=fused; or rollout.KEY=VALUE, the engine's, for decode alone "
                  "(e.g. rollout.scan_layers=False); or train.KEY=VALUE for the train step "
                  "alone (e.g. train.micro_batches=2: fewer, larger micro-batches)")
  ap.add_argument("--versus", action="append", default=[], metavar="model.KEY=VALUE",
                  help="also run every part with this setting on top (repeatable), and report "
                  "each part's speed with it over without, e.g. model.gdn_decode=fused "
                  "(rollout.KEY=VALUE: decode alone; train.KEY=VALUE: the train step alone)")
  ap.add_argument("--decode_prompt_len", type=int, default=0,
                  help="decode's prompt length (0 = the size's: 256 for 1b); a long one, e.g. "
                  "8192, is where model.decode_attention=fused reads less than xla")
  ap.add_argument("--decode_temperature", type=float, default=0.0,
                  help="decode's requests: 0 = greedy; 1 = sampled as RL rollouts are (the "
                  "draw over the vocabulary every token, which the roofline does not count)")
  ap.add_argument("--timeout", type=float, default=0.0,
                  help="seconds per benchmark (decode: twice); 0 = the size's (RUNS)")
  return ap.parse_args(argv)


def _setting(text: str) -> tuple:
  """--set's "model.KEY=VALUE" as (KEY, VALUE); "rollout.KEY=VALUE" (the engine's: decode
  alone) and "train.KEY=VALUE" (the train step alone) as ("rollout.KEY" / "train.KEY", VALUE)."""
  key, sep, value = text.partition("=")
  section, _, name = key.partition(".")
  if not sep or section not in ("model", "rollout", "train") or not name:
    raise SystemExit("accelerator.py: --set takes model.KEY=VALUE, rollout.KEY=VALUE or "
                     f"train.KEY=VALUE, got {text!r}")
  return (name if section == "model" else key), value


def _run_parts(ctx: dict, settings: dict, suffix: str = "") -> tuple:
  """The model step, train step and decode benchmarks with `settings` (model fields, and
  "rollout.KEY" ones for decode alone, "train.KEY" ones for the train step alone):
  ({"model_step", "train_step", "decode"}: each child's figures with MFU or the roofline share
  added, the model step's command); the children's logs are named with `suffix`."""
  py, dtype, run, fields, cfg = (ctx[k] for k in ("py", "dtype", "run", "fields", "cfg"))
  figures, timeout, env, out_dir = (ctx[k] for k in ("figures", "timeout", "env", "out_dir"))
  run_child, result = ctx["run_child"], {}
  over = {k: v for k, v in settings.items() if not k.startswith(("rollout.", "train."))}
  engine = {k: v for k, v in settings.items() if k.startswith("rollout.")}

  # Model step: forward + backward of the jitted model.
  step_cmd = [py, os.path.join(HERE, "model_step.py"), "--no_torch", f"--dtype={dtype}",
              "--compile_layers=", f"--batch={run['step_batch']}", f"--seq={run['step_seq']}"
              ] + [f"--{k}={v}" for k, v in step_flags(fields).items()] + [
                  f"--set=model.{k}={v}" for k, v in over.items()]
  ms, secs = run_child("model_step" + suffix, step_cmd + ["--iters=5"], timeout, env, out_dir)
  result["model_step"] = dict(ms, wall_s=secs)
  if "jax_tokens_per_s" in ms and figures:
    fpt = flops_per_token(cfg, run["step_seq"])
    result["model_step"]["mfu"] = fpt * ms["jax_tokens_per_s"] / figures[0]

  # Train step: the GRPO step on a synthetic batch; MFU from the config's FLOPs.
  train = {"train.prompts_per_step": run["prompts"], "train.samples_per_prompt": run["samples"],
           "train.seq_len": run["train_seq"], "train.max_context": run["train_seq"],
           "train.micro_batches": run["micro"],
           # Every weight trains, as a GPU run's recipe does: tiny_cpu.py trains the output
           # norm alone, whose step skips every other weight's optimizer update (the gradient
           # matmuls run either way: the compiled FLOPs of the two differ by ~1.5%).
           "optim.trainable": ""}
  train.update((k, v) for k, v in settings.items() if k.startswith("train."))
  cmd = [py, os.path.join(HERE, "train_step.py"), "--config=configs/tiny_cpu.py", "--steps=3"]
  cmd += [f"--config.{k}={v}" for k, v in train.items()]
  cmd += [f"--config.model.{k}={v}" for k, v in over.items()]
  ts, secs = run_child("train_step" + suffix, cmd, timeout, env, out_dir)
  result["train_step"] = dict(ts, wall_s=secs)
  if "tokens_per_s" in ts and figures:
    fpt = flops_per_token(cfg, run["train_seq"])
    result["train_step"]["flops_per_token"] = fpt
    result["train_step"]["mfu"] = fpt * ts["tokens_per_s"] / figures[0]

  # Decode: engine tokens/s against the HBM roofline.
  cmd = [py, os.path.join(HERE, "decode.py"), "--skip_hf", f"--dtype={dtype}",
         f"--prompt_len={run['prompt_len']}", f"--tokens={run['decode_tokens']}",
         f"--temperature={run['decode_temperature']}",
         "--concurrency=" + ",".join(str(c) for c in run["concurrency"])]
  cmd += [f"--set=model.{k}={v}" for k, v in over.items()]
  cmd += [f"--set={k}={v}" for k, v in engine.items()]
  dec, secs = run_child("decode" + suffix, cmd, 2 * timeout, env, out_dir)
  result["decode"] = dict(dec, wall_s=secs)
  if "engine_tokens_per_s" in dec and figures:
    context = run["prompt_len"] + run["decode_tokens"] / 2   # mean tokens cached per step
    wb = 2 if dtype == "bfloat16" else 4
    roof = {}
    pipelined = dec.get("engine_pipelined_tokens_per_s", {})
    for c, tps in dec["engine_tokens_per_s"].items():
      r = roofline_tokens_per_s(cfg, int(c), context, figures[1], weight_bytes=wb,
                                cache_bytes=wb)
      roof[c] = {"tokens_per_s": tps, "roofline_tokens_per_s": r, "of_roofline": tps / r}
      if c in pipelined:
        roof[c].update(pipelined_tokens_per_s=pipelined[c],
                       pipelined_of_roofline=pipelined[c] / r)
    result["decode"]["roofline"] = roof
  return result, step_cmd


def _ratios(base: dict, other: dict) -> dict:
  """Each part's tokens/s with the `--versus` settings over without (None where either failed);
  decode per concurrency, each step's tokens on the host and with one step in flight."""
  ratio = lambda a, b: b / a if a and b else None
  dec = lambda r, key: r.get(key, {})
  return {
      "model_step": ratio(base["model_step"].get("jax_tokens_per_s"),
                          other["model_step"].get("jax_tokens_per_s")),
      "train_step": ratio(base["train_step"].get("tokens_per_s"),
                          other["train_step"].get("tokens_per_s")),
      "decode": {c: ratio(t, dec(other["decode"], "engine_tokens_per_s").get(c))
                 for c, t in dec(base["decode"], "engine_tokens_per_s").items()},
      "decode_pipelined": {
          c: ratio(t, dec(other["decode"], "engine_pipelined_tokens_per_s").get(c))
          for c, t in dec(base["decode"], "engine_pipelined_tokens_per_s").items()},
  }


def main(argv=None, run_child=None):
  """The benchmark; `run_child(name, cmd, timeout, env, log_dir)` runs one child (default
  `_run`: a subprocess; a test passes a stand-in to check this process alone)."""
  args = parse_args(argv)
  run_child = run_child or _run
  settings = dict(_setting(s) for s in args.set)
  versus = dict(_setting(s) for s in args.versus)
  size_name = "smoke" if args.smoke else args.size
  size, run = SIZES[size_name], dict(RUNS[size_name])
  timeout = args.timeout or run["timeout"]
  if args.decode_prompt_len:
    run["prompt_len"] = args.decode_prompt_len
  run["decode_temperature"] = args.decode_temperature
  dtype = "bfloat16"   # params and compute, the smoke run too: the dtype the GPU runs
  out_dir = os.path.join(REPO, args.out) if not os.path.isabs(args.out) else args.out
  os.makedirs(out_dir, exist_ok=True)
  env = dict(os.environ)
  if args.smoke:
    env["JAX_PLATFORMS"] = "cpu"
  gpu = args.gpu_name
  if not gpu:
    if args.smoke:
      gpu = "NVIDIA H200"
    else:
      gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, check=True).stdout.splitlines()[0]
  figures = gpu_figures(gpu)
  cfg = model_config(size, dtype)
  counts = qwen3_5.count_params(cfg)   # shapes only: no backend starts here
  print(f"gpu {gpu}: peak bf16 {figures[0] / 1e12:.0f} TFLOP/s, HBM {figures[1] / 1e12:.2f} TB/s"
        if figures else f"gpu {gpu}: not in the table (no MFU / roofline)")
  print(f"model ({size_name}): {counts['total'] / 1e6:.1f} M params, "
        f"{counts['active'] / 1e6:.1f} M "
        f"active ({counts['total'] / counts['active']:.1f}x fewer), {dtype}")
  fields = model_overrides(size, dtype)
  result = {"gpu": gpu, "jax_version": jax.__version__, "smoke": args.smoke, "dtype": dtype,
            "size": size_name, "model": fields,
            "params": counts["total"], "active_params": counts["active"],
            "peak_flops": figures[0] if figures else None,
            "hbm_bytes_per_s": figures[1] if figures else None, "settings": settings,
            "decode_prompt_len": run["prompt_len"], "decode_temperature": args.decode_temperature}
  ctx = dict(py=sys.executable, dtype=dtype, run=run, fields=fields, cfg=cfg, figures=figures,
             timeout=timeout, env=env, out_dir=out_dir, run_child=run_child)
  parts, step_cmd = _run_parts(ctx, {**fields, **settings})
  result.update(parts)
  if versus:
    # The same three parts again with the `--versus` settings on top, on the same machine in
    # the same run: their ratios to the parts above are the comparison.
    other, _ = _run_parts(ctx, {**fields, **settings, **versus}, suffix="_versus")
    result["versus"] = dict(other, settings=versus, ratios=_ratios(parts, other))
    print(f"versus {versus}: " + json.dumps(result["versus"]["ratios"]))

  if args.breakdown:
    # Where the model step's time goes: each component jitted alone (model_step --breakdown).
    cmd = step_cmd + ["--iters=2", "--rounds=2", "--breakdown", "--breakdown_rounds=3"]
    bd, secs = run_child("breakdown", cmd, timeout, env, out_dir)
    result["breakdown"] = dict(bd.get("breakdown", bd), wall_s=secs)

  for name in ("model_step", "train_step", "decode"):
    peak = result[name].get("peak_bytes_in_use")
    print(f"[{name}] peak device memory: "
          + ("n/a" if peak is None else f"{peak / 2**30:.2f} GiB"))
  path = os.path.join(out_dir, "accelerator.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result))
  print(f"wrote {path}")
  failed = [k for k in ("model_step", "train_step", "decode") if "error" in result[k]]
  failed += [f"{k} (versus)" for k in ("model_step", "train_step", "decode")
             if "error" in result.get("versus", {}).get(k, {})]
  if failed:
    print(f"failed: {', '.join(failed)} (logs in {out_dir})")
    sys.exit(1)
  return result


if __name__ == "__main__":
  main()
