"""The embedded default: a tiny Qwen3.5 MoE doing level-1 agent tasks on a 2-core CPU.

`make run` = `launch.py --mode=rl` on this config: SFT on the oracle's level-1 train
trajectories, starting from the shipped tiny base checkpoint (assets/tiny_base), then GRPO on
level-1 train tasks, with a held-out eval (all 480 tasks of the eval split, level 1 like the
train split, in 9 eval worlds none of which training sees) before and after RL. Level 1 = one
named source, one tool call, one answer.

The base checkpoint plays the part the Qwen3.5 release plays for the full-size configs: the
weights the post-training starts from. It is built in two stages
(docs/experiments/tiny_base.md has the exact commands and figures):

  python launch.py --config=configs/tiny_cpu.py:copy --mode=sft   # content-copy drill, 1600 steps
  python launch.py --config=configs/tiny_cpu.py:base --mode=sft   # agent SFT on top, 150 steps

then continued at lower rates (650 agent-SFT steps in all, the last 300 on 3000 train tasks).
The `copy` stage teaches copying by content (an induction head) from a random init on synthetic
rows; the `base` stage trains on the oracle's trajectories of level-1 train tasks with a
language-modelling loss on every token and content-copy rows alongside. Only train-split worlds
feed it.

Sequence length is what costs on a CPU (the attention scores grow with its square), so the
policy sees only the seven read tools level-1 tasks need, each as a compact schema (name and
required parameters): the system turn is ~700 tokens instead of ~1500 (~4400 with all 24
tools and their descriptions).
"""
import os

from configs import base

LEVEL1_TOOLS = ("spreadsheets_read_sheet", "pdfs_read_pdf", "documents_read_document",
                "presentations_read_presentation", "mail_search_messages",
                "chat_read_channel", "calendar_list_events")
# Absolute, so the config means the same checkpoint from any working directory.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_CHECKPOINT = os.path.join(_REPO, "assets", "tiny_base")
COPY_CHECKPOINT = os.path.join(_REPO, "runs", "tiny_copy", "hf")


def get_config(arg=None):
  c = base.get_config()
  c.name = "tiny_cpu"
  # Thinking off and short turns: the tiny model answers or calls a tool directly.
  c.tokenizer.thinking = False
  # A level-1 episode is two turns (call, answer) of at most 62 tokens each in the oracle's
  # trajectories; one spare turn leaves room for a repaired call.
  c.harness.max_tokens_per_turn = 72
  c.harness.max_turns = 3
  c.harness.num_workers = 4
  c.harness.model_timeout_s = 300.0
  c.harness.episode_timeout_s = 900.0
  c.model.attention_query_chunk = 0
  # Queries in blocks of 512, each scored only against the keys up to its end: on 2560-token
  # rows this skips most of the masked half of the score work, with the same loss to the bit,
  # and makes make run faster; 256 gains a little more on short prefills but compiles longer
  # (python benchmarks/attention_blocks.py; figures in docs/results.md, "Figures behind the
  # tiny default's settings").
  c.model.attention_causal_block = 512
  # Copying a path from the prompt or a figure from a tool's output is the skill level-1 tasks
  # test. On the fixed-offset copy drill (benchmarks/copy_drill.py --row_len=64) the untied,
  # quarter-rotary model stays on the uniform-loss plateau far longer than one with the LM head
  # tied to the embedding and the whole head rotated (docs/results.md). Both are Hugging Face
  # config fields. (That drill is solved by relative position; copying by content takes the
  # content-copy rows: the `copy` variant, docs/experiments/tiny_base.md.)
  c.model.tie_word_embeddings = True
  c.model.partial_rotary_factor = 1.0
  # Level-1 trajectories are 0.8-2.3k tokens with the compact seven-tool system turn. The
  # training row (train.seq_len) and the engine's slot (rollout.max_len) follow this length.
  c.train.max_context = 2560
  # A prompt pads to the smallest bucket that holds it. First turns are ~0.8k tokens, later
  # turns up to 2.3k and mostly short: with two buckets most prefills paid for hundreds of pad
  # tokens; these five cost a few seconds more warmup and shorten the held-out eval, same pass@1
  # (python benchmarks/eval_speed.py; docs/results.md).
  c.rollout.prefill_buckets = (1024, 1280, 1536, 2048, 2304)
  # Every prompt opens with the same ~700-token system turn, which the engine prefills once per
  # weights version (rollout.prefix_cache); the rest of a prompt pads to one of these: first
  # turns leave ~100 tokens, later turns 300-1600. Each is one compile at first use
  # (docs/results.md#figures-behind-the-tiny-defaults-settings).
  c.rollout.prefix_buckets = (128, 512, 1024, 1792)
  c.rollout.slots = 8
  # The engine on one device: a 0.36M-parameter model gains nothing from being split, and on the
  # test suite's 8 host "devices" (the same cores) a split would only add collectives.
  c.rollout.mesh_shape = (1, 1, 1, 1)
  c.loop.tools = LEVEL1_TOOLS
  c.loop.tool_schema = "compact"
  c.loop.levels = (1,)
  c.loop.eval_levels = (1,)
  # Level-1 tasks only, in both splits: the held-out eval is then all 480 tasks of the eval split
  # (its 9 worlds), not the 168 level-1 ones of a mixed split, so its 95% intervals are
  # narrower, for a longer eval (docs/results.md).
  c.envs.level_weights = (1.0, 0.0, 0.0)
  c.sft.levels = (1,)
  # `make run` has 15 minutes on a 2-core CPU, a clean install included, and the install, the
  # worlds and the two held-out evals take most of it (docs/results.md has the phases;
  # docs/experiments/test_timings.md the clean-clone log, which varies by day up to 2x). So the
  # SFT is a short pass (the base has seen this task mix) and RL gets 12 steps of 8 prompts x 4
  # samples.
  c.train.init_from = BASE_CHECKPOINT
  c.sft.max_tasks = 32
  c.sft.steps = 4
  c.sft.batch_size = 8
  c.sft.lr = 3e-4
  c.sft.warmup_steps = 1
  c.sft.pad_multiple = 0
  # GRPO: the recipe (prompt_mean, DPPO binary-TV, no KL, temperature 1.0 for rollouts and the
  # held-out eval alike), updating only the output norm's 64 scales. A step here has a handful
  # of informative groups; over all 0.36M weights their gradient is mostly noise (full-network
  # steps lowered held-out pass@1, and the gradient noise scale puts a step that is more signal
  # than noise at ~180+ groups: docs/experiments/grad_noise.md). The output norm scales each
  # feature of the state the logits are read from, i.e. how sharply the policy commits to its
  # likeliest tokens per feature, the direction in which a policy that sometimes succeeds
  # improves first and on every task alike; at 1.0 the start is well below its own greedy
  # decoding. These settings were chosen on world seed 0 (a dev seed, configs/seeds.py); what
  # they do on the reporting seeds: `python benchmarks/rl_replication.py` (docs/results.md,
  # "Replication on reporting world seeds"; the runs and rates tried: "Why the tiny default
  # trains only the output norm, at 1.0").
  c.rl.temperature = 1.0
  c.optim.trainable = "final_norm"
  c.optim.lr = 0.2
  c.train.steps = 12
  c.train.prompts_per_step = 8
  c.train.samples_per_prompt = 4
  # One group per micro-batch: the step skips the micro-batches of filtered groups (all pass or
  # all fail), which are most of them. Over 8 devices the step runs 4 of 8 rows, one a device
  # (TrainStep.micro_batches).
  c.train.micro_batches = 8
  c.checkpoint.save_every = 2
  if arg == "base":
    _base_variant(c)
  elif arg == "copy":
    _copy_variant(c)
  elif arg:
    raise ValueError(f"configs/tiny_cpu.py takes no argument, 'base' or 'copy', got {arg!r}")
  return c


def _base_variant(c):
  """Second stage of assets/tiny_base: agent SFT with an LM loss, from the `copy` stage."""
  c.name = "tiny_base"
  c.train.init_from = COPY_CHECKPOINT
  # More level-1 tasks on the same train worlds (3000 distinct prompts exist; the eval worlds
  # stay untouched).
  c.envs.train_tasks = 2000
  c.sft.max_tasks = 0
  c.sft.steps = 150
  c.sft.lr = 3e-3
  c.sft.warmup_steps = 10
  c.sft.pad_multiple = 256
  c.sft.lm_loss_weight = 0.3
  # Dense content-copy rows next to the agent data keep the copy circuit of the first stage
  # (16-token segments at random places in 256-token rows of random tokens). Rows with the
  # copy at a fixed offset (copy_drill_row_len = 2 x copy_drill_len) are solved by relative
  # position and teach nothing that carries over to a prompt (docs/experiments/tiny_base.md).
  c.sft.copy_drill_rows = 32
  c.sft.copy_drill_len = 16
  c.sft.copy_drill_row_len = 256
  c.sft.eval_every = 50
  c.sft.eval_tasks = 48
  c.sft.save_every = 50
  c.sft.export_hf = BASE_CHECKPOINT


def _copy_variant(c):
  """First stage of assets/tiny_base: content-copy drill from a random init, rows only (segment
  and copy at random places in 128-token rows of random tokens), exported to COPY_CHECKPOINT.

  The copy loss sits at the uniform value for most of the run, then falls within a few hundred
  steps (the induction-head phase change); the curve and the copy accuracy at the end are in
  docs/experiments/tiny_base.md.
  """
  c.name = "tiny_copy"
  c.train.init_from = ""
  c.sft.max_tasks = 8                # collected but unused: every step is a drill step
  c.sft.steps = 1600
  c.sft.copy_drill_only_steps = 1600
  c.sft.copy_drill_rows = 32
  c.sft.copy_drill_len = 16
  c.sft.copy_drill_row_len = 128
  c.sft.lr = 1e-3
  c.sft.warmup_steps = 10
  c.sft.schedule = "constant"
  c.sft.save_every = 100
  c.sft.eval_every = 0
  c.sft.export_hf = COPY_CHECKPOINT
