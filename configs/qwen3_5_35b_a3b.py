"""Qwen3.5-35B-A3B, RL with the report's recipe, on 2 nodes of 8 H200 (16 devices).

  python launch.py --mode=plan --config=configs/qwen3_5_35b_a3b.py

Mesh: experts over `expert` (256 experts / 8) and their other dimension over `fsdp` (2), the
other weights FSDP over all 16 devices (`fsdp` x `expert`); each 160k row's tokens over all 16
devices (context parallelism). Compiled from a CPU, the RL step fits at 160k on its 16 H200s
(84.3 GiB of 141 a GPU; ~1 minute of compile: `--mode=compile --config.compile.target=h200:2x8`)
and on a v5p:2x2x4 slice (88.8 GiB of 95 a chip;
docs/results.md#full-size-programs-compiled-for-their-targets). Precision and hyperparameters:
configs/report_recipe.py. On GPUs, `--config.model.gdn_scan=fused` runs each Gated DeltaNet walk
over its chunks as one kernel (far fewer kernel launches a step), and
`--config.model.decode_attention=fused` each decode step's read of the KV cache (each row to its
own length, no block copied), `--config.model.gdn_decode=fused` each decode step's Gated
DeltaNet state update (each state read and written once, in place) and
`--config.model.moe_dispatch=blocked_fused` the routed experts' matmuls and their gradients
(read in place, not gathered per block), and `--config.rollout.scan_layers=False` has the
engine hold its weights layer by layer (a decode step copies no weight slice; its programs
compile ~4x slower: docs/rollout.md#engine-weights); none has run on a GPU yet, so none is the
default: docs/accelerators.md#compiling-for-a-slice-from-a-cpu.
Several hosts: the rollout servers run as their own jobs (`launch.py --mode=serve
--config.rollout.mesh_shape=...` on each; `rollout.servers` and `rollout.weights_dir` for the
trainer): an in-process engine serves from one process only (rl/rollout/README.md).
"""
from configs import base
from configs import report_recipe


def get_config(arg=None):
  del arg
  c = report_recipe.apply(base.get_config(), "qwen3_5_35b_a3b")
  c.mesh.shape = (1, 2, 8, 1)        # data, fsdp, expert, tensor = 16 devices
  # 256 rows / 128 = 2 a micro-batch, each split over the 16 devices; what that takes a device:
  # --mode=plan, docs/results.md#memory-plans-of-the-full-size-configs.
  c.train.micro_batches = 128
  c.plan.num_devices = 16
  # The engine keeps its non-expert weights whole on each device rather than
  # all-gathering them every decode step (docs/rollout.md, "Engine weights").
  c.rollout.whole_weights = True
  return c
