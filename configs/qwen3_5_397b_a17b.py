"""Qwen3.5-397B-A17B, RL with the report's recipe, on 8 nodes of 8 H200 (64 devices).

  python launch.py --mode=plan --config=configs/qwen3_5_397b_a17b.py

Mesh: experts over `expert` (512 experts / 8) and their embed dimension over `fsdp` (8), the
other weights FSDP over all 64 devices (`fsdp` x `expert`); each 160k row's tokens over all 64
devices (context parallelism over `fsdp` x `expert`). Precision and hyperparameters: configs/report_recipe.py.
For a TPU v5p-512 slice (256 chips of 95 GiB), the layout `v5p512`:

  python launch.py --mode=compile --config=configs/qwen3_5_397b_a17b.py:v5p512 --config.compile.target=v5p:8x8x4

(~3 minutes of compile on a 2-core CPU; 77 GiB a chip, compiler figures in
docs/results.md#full-size-programs-compiled-for-their-targets). Each row over 64 chips
(`fsdp` x `expert`: the Gated DeltaNet's 64 value heads split one a chip; over all 256 the
heads cannot split and XLA holds whole rows of them, 130 GiB a chip), 4 rows a micro-batch
over `data`, and the weights FSDP over `data` x `fsdp` x `expert` (an expert weight over `data` x
`fsdp`, its experts over `expert`).
On 64 H200s the step does not fit (205.8 GiB a GPU compiled, 69.7 of them float32 masters and
AdamW moments); the layout `h200x128`, 16 nodes of 8 H200, fits (108.8 GiB of 141):

  python launch.py --mode=compile --config=configs/qwen3_5_397b_a17b.py:h200x128 --config.compile.target=h200:16x8

rows as in `v5p512`, 2 at a time over `data`, the weights over all 128 GPUs (~1.5 minutes).
On GPUs, `--config.model.gdn_scan=fused`, `--config.model.decode_attention=fused` and
`--config.model.moe_dispatch=blocked_fused`: as in configs/qwen3_5_35b_a3b.py.
Several hosts: the rollout servers run as their own jobs (`launch.py --mode=serve
--config.rollout.mesh_shape=...` on each; `rollout.servers` and `rollout.weights_dir` for the
trainer): an in-process engine serves from one process only (rl/rollout/README.md).
"""
from configs import base
from configs import report_recipe
from models import sharding


LAYOUTS = ("", "v5p512", "h200x128")


def get_config(arg=None):
  layout = arg or ""
  if layout not in LAYOUTS:
    raise ValueError(f"qwen3_5_397b_a17b.py: unknown layout {layout!r}; one of {LAYOUTS[1:]} "
                     "or none (64 H200s)")
  c = report_recipe.apply(base.get_config(), "qwen3_5_397b_a17b")
  c.mesh.shape = (1, 8, 8, 1)        # data, fsdp, expert, tensor = 64 devices
  # The float32 masters and Adam moments take most of an H200: a micro-batch holds 2 rows, each
  # split over the 64 devices (with rows split over `fsdp` alone no micro-batching fits); what
  # that takes a device: --mode=plan, docs/results.md#memory-plans-of-the-full-size-configs.
  c.train.micro_batches = 128
  c.plan.num_devices = 64
  if layout in ("v5p512", "h200x128"):
    # Each row over 64 devices (`fsdp` x `expert`), rows side by side over `data`, the weights
    # FSDP over all three (an expert weight over `data` x `fsdp`, its experts over `expert`).
    c.mesh.rules = sharding.with_targets(c.mesh.rules, embed=[("data", "fsdp", "expert"),
                                                              ("data", "fsdp")])
  if layout == "v5p512":
    c.mesh.shape = (4, 8, 8, 1)      # 256 chips: 4 rows at a time, each over 64
    c.train.micro_batches = 64       # 256 rows / 64 = 4 a micro-batch, one a `data` group
    c.plan.num_devices = 256
    c.plan.device_kind, c.plan.device_memory_gib = "TPU v5p", 95
  if layout == "h200x128":
    c.mesh.shape = (2, 8, 8, 1)      # 16 nodes of 8 H200: 2 rows at a time, each over 64
    c.plan.num_devices = 128         # 128 micro-batches of 2 rows, one a `data` group
  return c
