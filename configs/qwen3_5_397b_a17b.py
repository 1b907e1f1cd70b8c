"""Qwen3.5-397B-A17B, RL with the report's recipe, on 8 nodes of 8 H200 (64 devices).

  python launch.py --mode=plan --config=configs/qwen3_5_397b_a17b.py

Mesh: experts over `expert` (512 experts / 8), dense weights and the expert weights' embed
dimension FSDP over `fsdp` (8), the batch over both. Float32 master weights, bfloat16
compute, full remat per layer cycle. For a TPU v5p-512 slice (256 chips of 95 GiB):
  --config.mesh.shape="(1,32,8,1)" --config.plan.num_devices=256
  --config.plan.device_kind="TPU v5p" --config.plan.device_memory_gib=95
"""
from configs import base


def get_config(arg=None):
  del arg
  c = base.get_config()
  c.name = "qwen3_5_397b_a17b"
  c.model.preset = "qwen3_5_397b_a17b"
  c.model.param_dtype = "float32"
  c.model.dtype = "bfloat16"
  c.model.remat = "full"
  c.model.attention_query_chunk = 2048   # scores memory O(2048 * seq) rather than O(seq^2)

  c.mesh.shape = (1, 8, 8, 1)        # data, fsdp, expert, tensor = 64 devices

  # The recipe (SkyRL scripts of the report).
  c.rl.advantage = "grpo"
  c.rl.grpo_norm_by_std = False
  c.rl.filter_zero_variance = True
  c.rl.policy_loss = "dppo_binary_tv"
  c.rl.dppo.delta_low = 0.15
  c.rl.dppo.delta_high = 0.15
  c.rl.loss_reduction = "prompt_mean"
  c.rl.kl.coef = 0.0
  c.rl.temperature = 1.0
  c.optim.lr = 1e-6
  c.optim.weight_decay = 0.01
  c.optim.b1, c.optim.b2 = 0.9, 0.98
  c.optim.grad_clip = 1.0
  c.train.prompts_per_step = 16
  c.train.samples_per_prompt = 16
  c.train.mini_batches = 1
  c.train.micro_batches = 4          # 256 rows / 64 devices / 4 = 1 row per device per micro-batch
  c.train.seq_len = 32_768           # padded training row; trajectories up to max_context
  c.train.max_context = 160_000
  c.train.steps = 200

  c.checkpoint.save_every = 10
  c.checkpoint.keep = 3

  c.plan.num_devices = 64
  c.plan.device_kind = "H200"
  c.plan.device_memory_gib = 141.0
  c.plan.seq_lens = (8_192, 32_768, 65_536, 163_840)
  return c
