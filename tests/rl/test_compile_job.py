"""--mode=compile (rl/compile_job.py): the job's programs compiled for TPU and GPU targets from
this CPU, on a small config (a few seconds of compile each)."""
import functools
import json
import os
import subprocess
import sys

import jax
import pytest

from configs import base
from models import aot
from models import qwen3_5
from models import sharding
from models.layers import moe
from rl import compile_job
from rl import train_step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _small(**overrides):
  c = base.get_config()
  c.train.prompts_per_step, c.train.samples_per_prompt = 2, 4
  c.train.seq_len = 64
  c.train.micro_batches = 2
  c.sft.steps, c.sft.batch_size, c.sft.pad_multiple = 1, 4, 64
  c.rollout.max_len, c.rollout.prefill_buckets, c.rollout.slots = 128, (64,), 4
  c.compile.engine_buckets = (64,)
  c.update_from_flattened_dict(overrides)
  return c


@functools.lru_cache(maxsize=None)
def _compiled(target: str, program: str, overrides: tuple = ()) -> tuple:
  """compile_job.run's rows for one program of _small(**dict(overrides)) on `target`, compiled
  once a test process: a test file runs in one process (`--dist loadfile`), so two tests that
  need the same program share its compile."""
  return tuple(compile_job.run(_small(**dict(overrides)), target, (program,)))


# Slow (`make test-all`, CI; 1-2.5 minutes of compile each), to keep `make test` near its
# 20-minute budget on 2 cores: the quick suite compiles the RL step for h200:2x1 through
# test_launch_compile_mode_prints_a_report_and_a_json_last_line and the train step for
# v5p:2x2x1 through test_the_train_step_compiles_with_the_shardings_the_config_names.
@pytest.mark.slow
@pytest.mark.parametrize("target", ["v5p:2x2x1", "h200:1x2"])
def test_the_tiny_job_compiles_for_a_tpu_slice_and_for_two_gpus(target):
  """Every program of the job compiles for the target and reports memory against the device's
  HBM, FLOPs against the model's, and collectives."""
  # The SFT step on one target: the same model code as the RL step, a minute of compile here.
  programs = ("rl_step", "sft_step", "engine") if target.startswith("v5p") else ("rl_step", "engine")
  rows = {r["program"]: r for p in programs for r in _compiled(target, p)}
  assert set(rows) == {"engine/prefill_64", "engine/insert_64", "engine/generate", *programs} - {"engine"}
  spec = aot.parse_target(target).spec
  for r in rows.values():
    assert r["fits"] and r["hbm_bytes"] == spec.hbm_bytes
    assert 0 < r["memory"]["total"] < spec.hbm_bytes
  step = rows["rl_step"]
  # The step does at least the model's work and (tiny model: attention and the delta rule's
  # chunk products are a large share) not an order of magnitude more.
  assert 1.0 <= step["flops_ratio"] < 10.0, step["flops_ratio"]
  # Two devices of one mesh: the gradients' reduction is a collective.
  assert step["collectives"], step
  assert rows["engine/prefill_64"]["flops"] > 0 and rows["engine/generate"]["flops"] > 0
  # The capacity planner counts what the generate step holds as arguments: the weights and every
  # slot's decode state (plus the small per-slot sampling state and logits it leaves out).
  gen = rows["engine/generate"]
  assert gen["slots"] == 4 and gen["max_len"] == 128
  ratio = gen["memory"]["argument"] / gen["planner_bytes_per_device"]
  # (On TPU the tiny model's 16-wide minor dimensions are padded to tiles of 128 lanes: 2.9x.)
  assert 1.0 <= ratio < (1.25 if spec.platform == "cuda" else 4.0), ratio
  if "estimated_seconds" in step:  # XLA:TPU gives its estimate for larger programs only
    assert step["estimated_seconds"] > 0 and 0 < step["estimated_mfu"] < 1


@pytest.mark.slow   # two engine compiles for two GPUs; `make test-all`, CI
def test_whole_engine_weights_leave_the_decode_step_no_weight_to_gather():
  """rollout.whole_weights: the generate step for two H200s moves no weight (its FSDP-split
  weights were all-gathered every step), and the planner's bytes still track its arguments."""
  gathered = {}
  assert not base.get_config().rollout.whole_weights   # so False is the tiny job's own compile
  for whole in (False, True):
    rows = {r["program"]: r for r in _compiled(
        "h200:1x2", "engine", (("rollout.whole_weights", True),) if whole else ())}
    gen = rows["engine/generate"]
    gathered[whole] = gen["collectives"].get("all-gather", {}).get("bytes", 0)
    assert 1.0 <= gen["memory"]["argument"] / gen["planner_bytes_per_device"] < 1.25
  weights = 2 * qwen3_5.count_params(qwen3_5.config_from_dict(_small().model))["total"]
  assert gathered[True] == 0 and gathered[False] > weights / 4, (gathered, weights)


@pytest.mark.slow   # two RL-step compiles for two GPUs (~1.5 min); `make test-all`, CI
def test_the_fused_gated_deltanet_kernels_cut_the_gpu_steps_launches_and_bytes():
  """model.gdn_scan=fused compiles the RL step for two H200s with the chunked rule as Triton
  kernels (in their shard_map), with fewer launches and fewer HBM bytes than the scan over
  chunks."""
  c = _small(**{"train.seq_len": 1024})
  scan, = compile_job.run(c, "h200:1x2", ("rl_step",))
  c.model.gdn_scan = "fused"
  fused, = compile_job.run(c, "h200:1x2", ("rl_step",))
  assert fused["custom_calls"].get("__gpu$xla.gpu.triton", 0) > 0
  assert "__gpu$xla.gpu.triton" not in scan["custom_calls"]
  assert fused["kernels"] < scan["kernels"] / 2, (fused["kernels"], scan["kernels"])
  assert fused["traffic_bytes"] < scan["traffic_bytes"], (fused["traffic_bytes"],
                                                          scan["traffic_bytes"])


@pytest.mark.slow   # two engine compiles for two GPUs; `make test-all`, CI
def test_the_fused_decode_attention_leaves_the_gpu_decode_step_no_loop_over_the_cache():
  """model.decode_attention=fused compiles the engine's generate step for two H200s with each
  attention layer's read of the cache one Triton kernel (in its shard_map): the loop over the
  cache's blocks, whose trip count follows the longest row, is gone, and with it the all-reduce
  of that length across the devices."""
  rows = {}
  for mode in ("xla", "fused"):
    c = _small(**{"model.decode_attention": mode, "rollout.max_len": 4096})   # 2 blocks
    gen, = (r for r in compile_job.run(c, "h200:1x2", ("engine",))
            if r["program"] == "engine/generate")
    rows[mode] = gen
  assert rows["xla"]["unknown_trip_counts"] and not rows["fused"]["unknown_trip_counts"]
  assert rows["fused"]["custom_calls"].get("__gpu$xla.gpu.triton", 0) > 0
  assert "__gpu$xla.gpu.triton" not in rows["xla"]["custom_calls"]
  assert rows["fused"]["kernels"] < rows["xla"]["kernels"]
  reduced = lambda r: r["collectives"].get("all-reduce", {}).get("count", 0)
  assert reduced(rows["fused"]) < reduced(rows["xla"])


@pytest.mark.parametrize("shape,devices,want", [
    ((1, 2, 8, 1), 16, (1, 2, 8, 1)),     # the config's own slice: as configured
    ((1, 2, 8, 1), 64, (1, 8, 8, 1)),     # a larger slice: fsdp takes the difference
    ((2, 2, 8, 1), 8, (1, 1, 8, 1)),      # data folds into fsdp before the experts shrink
    ((1, 2, 8, 1), 4, (1, 1, 4, 1)),      # fewer devices than experts' ways: expert shrinks
    ((1, 8, 8, 1), 48, (1, 6, 8, 1)),
    ((1, -1, 1, 1), 4, (1, 4, 1, 1))])
def test_a_configs_mesh_is_fitted_to_the_targets_device_count(shape, devices, want):
  """A hidden (config, target) pair compiles on the target's devices: the config's mesh is
  kept when it fits and otherwise refitted with a note; one that fits no way names why."""
  axes = ("data", "fsdp", "expert", "tensor")
  fitted, note = compile_job.mesh_for_target(axes, shape, devices)
  assert fitted == want
  assert (note == "") == (tuple(shape) == want or -1 in shape)
  if note:
    assert f"{devices} devices" in note and str(want) in note
  with pytest.raises(sharding.MeshError, match="differ in length"):
    compile_job.mesh_for_target(axes, (1, 2, 8), devices)


def test_the_train_step_compiles_with_the_shardings_the_config_names():
  """The compiled step's state arguments are laid out as the config's rules say: FSDP weights
  split over `fsdp`, experts over `expert`."""
  c = _small(**{"mesh.shape": (1, 2, 2, 1)})
  mesh = sharding.make_mesh(c.mesh, aot.target_devices("v5p:2x2x1"))
  lowered, _, _ = compile_job.rl_step_program(c, mesh, 64)
  compiled = lowered.compile()
  state_in = compiled.input_shardings[0][0]
  step = train_step.TrainStep(c, mesh)
  want = jax.tree.map(lambda s: s.spec, step.state_shardings)
  got = jax.tree.map(lambda s: s.spec, state_in)
  assert got == want
  experts = got["params"]["blocks"][0]["ffn"]["wi_gate"]
  assert experts[1] == "expert" and experts[2] == "fsdp"


def test_moe_flops_on_tpu_do_not_grow_with_the_number_of_experts():
  """At fixed top-k, 64 experts cost less than twice the matmul FLOPs of 8 in the compiled TPU
  program, where a dense all-expert computation would cost 8x. (The compiled count is of the
  static worst case: up to min(experts, pairs) x (block - 1) padding rows, models/layers/moe.py,
  and the router's [embed, experts] matmul; measured 1.58x.)"""
  dev = aot.target_devices("v5p:2x2x1")[0]
  one = jax.sharding.SingleDeviceSharding(dev)
  flops = {}
  for e in (8, 64):
    c = base.get_config()
    c.model.num_experts, c.model.num_experts_per_tok = e, 2
    mc = qwen3_5.config_from_dict(c.model)
    p = jax.eval_shape(lambda k: moe.init(k, mc), jax.random.key(0))
    p = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), p)
    x = jax.ShapeDtypeStruct((4, 512, mc.hidden_size), mc.jnp_dtype, sharding=one)
    f = jax.jit(jax.grad(lambda p, x: moe.forward(p, x, mc)[0].sum()))
    flops[e] = aot.hlo_costs(f.lower(p, x).compile().as_text())["flops"]
  assert flops[64] < 2.0 * flops[8], flops


def test_launch_compile_mode_prints_a_report_and_a_json_last_line():
  """`launch.py --mode=compile` as a user runs it (a config whose mesh names other than the
  target's device count is refitted; two hosts of one GPU, so that the collectives between
  hosts are counted apart; the kernels' roofline and its top source lines); a missing target
  is a one-line error."""
  cmd = [sys.executable, "launch.py", "--mode=compile", "--config=configs/tiny_cpu.py",
         "--config.compile.target=h200:2x1", "--config.compile.programs=('rl_step',)",
         "--config.train.seq_len=64", "--config.train.prompts_per_step=2",
         "--config.train.samples_per_prompt=2", "--config.train.micro_batches=1",
         "--config.mesh.shape=(1,4,1,1)",   # a 4-device mesh, compiled for the target's 2
         "--config.compile.kernel_lines=5"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  last = json.loads(out.stdout.strip().splitlines()[-1])
  assert last["target"] == "h200:2x1" and last["programs"][0]["program"] == "rl_step"
  # The data-parallel gradient sum crosses the two hosts.
  assert "of which between hosts:" in out.stdout
  assert any(v["between_hosts"] > 0 for v in last["programs"][0]["collectives"].values())
  assert "memory/device:" in out.stdout and "of 141.0" in out.stdout
  assert "kernels/device a step" in out.stdout and last["programs"][0]["kernels"] > 0
  # The roofline estimate, and the source lines whose kernels take longest by it.
  prog = last["programs"][0]
  assert "roofline estimate:" in out.stdout and 0 < prog["roofline_mfu"] < 1
  lines = prog["kernel_lines"]
  assert len(lines) == 5 and lines[0]["seconds"] >= lines[-1]["seconds"] > 0
  assert any(k["where"].startswith(("models/", "rl/")) for k in lines)
  assert "compiling with mesh.shape (1, 2, 1, 1)" in out.stdout
  # The plan's analytic bytes for the same step, beside the compiler's.
  assert "--mode=plan says" in out.stdout and last["programs"][0]["plan_bytes"] > 0
  bad = subprocess.run(cmd[:3], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert bad.returncode != 0 and "needs a target" in bad.stderr
