"""Qwen3.5-35B-A3B, RL with the report's recipe, on 2 nodes of 8 H200 (16 devices).

  python launch.py --mode=plan --config=configs/qwen3_5_35b_a3b.py

Mesh: experts over `expert` (256 experts / 8) and their other dimension over `fsdp` (2), the
other weights FSDP over all 16 devices (`fsdp` x `expert`); each 160k row's tokens over the 8
GPUs of one node (context parallelism over `expert`), the two rows of a micro-batch one a node
(`fsdp`): the sequence mixers' all-to-alls stay on a node's NVLink instead of crossing the
InfiniBand between the nodes (less than half the bytes between them of a row over all 16, about
the same memory). Compiled from a CPU, the RL step fits at 160k on its 16 H200s (96 GiB of 141 a
GPU; ~1 minute of compile: `--mode=compile --config.compile.target=h200:2x8`). For a v5p:2x2x4
slice, whose 16 chips share one interconnect, the layout `v5p` splits each row over all 16
(XLA:TPU's time estimate 479 s a step against 531 for rows over 8; 89.0 GiB of 95 a chip):

  python launch.py --mode=compile --config=configs/qwen3_5_35b_a3b.py:v5p --config.compile.target=v5p:2x2x4

Figures: docs/results.md#full-size-programs-compiled-for-their-targets. Precision and
hyperparameters: configs/report_recipe.py. On GPUs, `--config.model.gdn_scan=fused` runs each
Gated DeltaNet walk over its chunks, and each chunk's solve and outputs, as kernels (far fewer
kernel launches and bytes a step), and
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
from models import sharding


LAYOUTS = ("", "v5p")


def get_config(arg=None):
  layout = arg or ""
  if layout not in LAYOUTS:
    raise ValueError(f"qwen3_5_35b_a3b.py: unknown layout {layout!r}; one of {LAYOUTS[1:]} "
                     "or none (2 nodes of 8 H200)")
  c = report_recipe.apply(base.get_config(), "qwen3_5_35b_a3b")
  c.mesh.shape = (1, 2, 8, 1)        # data, fsdp, expert, tensor = 16 devices
  # 256 rows / 128 = 2 a micro-batch; what that takes a device: --mode=plan,
  # docs/results.md#memory-plans-of-the-full-size-configs.
  c.train.micro_batches = 128
  c.plan.num_devices = 16
  if layout != "v5p":
    # Each row over one node's 8 GPUs (`expert`), the micro-batch's 2 rows over the nodes
    # (`fsdp`), in place of the recipe's rows over all 16: 35B-A3B's step on h200:2x8 moved
    # 7.4k GiB a GPU between the nodes against 16.5k, in 95.6 GiB against 93.9 (compiler
    # figures, docs/results.md#the-experts-collectives-written-out).
    c.mesh.rules = sharding.context_parallel_rules(
        sharding.without_context_parallel(c.mesh.rules), ("expert",))
  else:
    c.plan.device_kind, c.plan.device_memory_gib = "TPU v5p", 95
  # The engine keeps its non-expert weights whole on each device rather than
  # all-gathering them every decode step (docs/rollout.md, "Engine weights").
  c.rollout.whole_weights = True
  return c
