"""The RL recipe of the report (SkyRL scripts), shared by the full-size configs.

Float32 master weights (lr 1e-6 updates vanish in bfloat16), bfloat16 compute, full remat per
layer cycle, query-chunked attention.

The model preset and the derived values here are defaults, not copies: the fields the preset
names follow `model.preset`, the engine's `rollout.max_len` follows `train.max_context` and its
kept turns follow prompts x samples (configs/references.py). So
`--config.model.num_hidden_layers=4` or `--config.train.max_context=4096` on a full-size config
takes effect, and setting a derived key itself wins over its source.
"""
from configs import references
from models import sharding


def apply(c, preset: str):
  """Sets the full-size model `preset` and the report's hyperparameters on config `c`.

  The preset gives the defaults of the model fields it names (models/presets.py): a field set
  after this, or on the command line, keeps the value set.
  """
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
  # A training row holds the longest trajectory the harness allows (160 x 1024 >= 160k; the
  # loop refuses less). Such a row is split over the `fsdp` x `expert` devices (context
  # parallelism: each holds its share of the row's activations, attention gathers keys and
  # values), rows spread over `data`; the configs pick micro-batches with room for twice the
  # plan's activations (on host devices the split saved half what the plan's model says:
  # docs/model.md, "Context parallelism is a sharding rule").
  c.train.seq_len = 163_840
  c.train.max_context = 160_000
  # A step whose longest trajectory is shorter pads its rows to the first of these that holds
  # it instead (one compile each): most steps need not pay for 160k rows.
  c.train.seq_buckets = (16_384, 32_768, 65_536)
  c.mesh.rules = sharding.context_parallel_rules(c.mesh.rules, ("fsdp", "expert"))
  c.train.steps = 200
  # The released Qwen3.5 weights, as a local Hugging Face directory (set it per run:
  # --config.train.init_from=/path/to/Qwen3.5-35B-A3B); the report runs RL straight from it.
  c.train.init_from = ""

  c.checkpoint.save_every = 10
  c.checkpoint.keep = 3

  # Rollout serving (rl/rollout/README.md). A slot holds the whole context the harness lets an
  # episode reach (capacity.check_context refuses less): rollout.max_len follows
  # train.max_context (configs/base.py).
  # Weight matrices served in bfloat16, as the report's engines serve them: float32 masters
  # would double the engine's weights (397B: 1.6 TB, more than 8 H200 hold). The trainer's
  # float32 params are cast on each weight sync; rollout logprobs come from the bfloat16 copy
  # and the policy loss's ratios against them absorb the difference.
  c.rollout.weights_dtype = "bfloat16"
  # Prompts grow to 160k; pads stay within 4x of the prompt (+ max_len - 1, added by the
  # engine). Each prefill bucket is one compile at warmup, each prefix bucket one at first use.
  c.rollout.prefill_buckets = (1024, 4096, 16_384, 65_536, 131_072)
  c.rollout.prefix_buckets = (256, 1024, 4096, 16_384, 65_536, 131_072)
  # Up to 100 turns an episode: without the turn cache every turn prefills its whole
  # conversation again (O(turns^2) tokens). One kept turn per in-flight episode (16 x 16); each
  # holds one slot's state at max_len (3 GiB for 35B-A3B, 4.6 GiB for 397B-A17B), and the
  # planner sets them against the engine's memory. Unmeasured on accelerators (rl/rollout/README.md).
  # Follows the two keys until set itself.
  c.rollout.turn_cache = references.product(c.train, "prompts_per_step", "samples_per_prompt")
  c.rollout.stop_ids = (248046, 248044)   # <|im_end|>, <|endoftext|>

  c.plan.device_kind = "H200"
  c.plan.device_memory_gib = 141.0
  c.plan.seq_lens = (8_192, 32_768, 65_536, 163_840)
  return c
