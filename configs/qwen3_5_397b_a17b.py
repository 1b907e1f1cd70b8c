"""Qwen3.5-397B-A17B, RL with the report's recipe, on 8 nodes of 8 H200 (64 devices).

  python launch.py --mode=plan --config=configs/qwen3_5_397b_a17b.py

Mesh: experts over `expert` (512 experts / 8), dense weights and the expert weights' embed
dimension FSDP over `fsdp` (8); each 160k row's tokens over all 64 devices (context
parallelism over `fsdp` x `expert`). Precision and hyperparameters: configs/report_recipe.py.
For a TPU v5p-512 slice (256 chips of 95 GiB; 63 GiB a chip by --mode=plan, 99 with twice
the activations):
  --config.mesh.shape="(1,32,8,1)" --config.plan.num_devices=256 --config.train.micro_batches=16
  --config.plan.device_kind="TPU v5p" --config.plan.device_memory_gib=95
Several hosts: the rollout servers run as their own jobs (`launch.py --mode=serve
--config.rollout.mesh_shape=...` on each; `rollout.servers` and `rollout.weights_dir` for the
trainer): an in-process engine serves from one process only (rl/rollout/README.md).
"""
from configs import base
from configs import report_recipe


def get_config(arg=None):
  del arg
  c = report_recipe.apply(base.get_config(), "qwen3_5_397b_a17b")
  c.mesh.shape = (1, 8, 8, 1)        # data, fsdp, expert, tensor = 64 devices
  # The float32 masters and Adam moments take most of an H200: a micro-batch holds 2 rows, each
  # split over the 64 devices (with rows split over `fsdp` alone no micro-batching fits); what
  # that takes a device: --mode=plan, docs/results.md#memory-plans-of-the-full-size-configs.
  c.train.micro_batches = 128
  c.plan.num_devices = 64
  return c
