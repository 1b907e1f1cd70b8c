"""The RL recipe of the report (SkyRL scripts), shared by the full-size configs.

Float32 master weights (lr 1e-6 updates vanish in bfloat16), bfloat16 compute, full remat per
layer cycle, query-chunked attention.
"""


def apply(c, preset: str):
  """Sets the full-size model `preset` and the report's hyperparameters on config `c`."""
  c.name = preset
  c.model.preset = preset
  c.model.param_dtype = "float32"
  c.model.dtype = "bfloat16"
  c.model.remat = "full"
  c.model.attention_query_chunk = 2048   # scores memory O(2048 * seq) rather than O(seq^2)
  c.model.logits_chunk = 2048            # vocab-sized logits for 2048 positions at a time

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
  c.train.seq_len = 32_768           # padded training row; trajectories up to max_context
  c.train.max_context = 160_000
  c.train.steps = 200
  # The released Qwen3.5 weights, as a local Hugging Face directory (set it per run:
  # --config.train.init_from=/path/to/Qwen3.5-35B-A3B); the report runs RL straight from it.
  c.train.init_from = ""

  c.checkpoint.save_every = 10
  c.checkpoint.keep = 3

  c.plan.device_kind = "H200"
  c.plan.device_memory_gib = 141.0
  c.plan.seq_lens = (8_192, 32_768, 65_536, 163_840)
  return c
