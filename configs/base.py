"""Every knob with its default, in one place.

Setup files (tiny_cpu.py, qwen3_5_35b_a3b.py, ...) start from `get_config()` here and change
only what differs. Code reads the config; it never invents defaults of its own.

A default derived from another key follows it (configs/references.py): `train.seq_len` and
`rollout.max_len` follow `train.max_context`, and the model fields a preset names follow
`model.preset` (models/presets.py), each until it is set itself. So an override of the source,
in a config file, on the command line or in a sweep, reaches them, and an override of the
derived key wins. launch.py prints the resolved config's differences from `get_config()` here.
"""
import ml_collections

from configs import references


def get_model_config() -> ml_collections.ConfigDict:
  """The Qwen3.5 text model. Field names follow the Hugging Face `text_config`."""
  m = ml_collections.ConfigDict()
  m.preset = ""                      # preset of models/presets.py whose values the fields it names default to (until set); "" = the values below
  m.vocab_size = 1024                # tokens in the embedding table / LM head
  m.hidden_size = 64                 # residual stream width
  m.num_hidden_layers = 4            # depth; layer i is attention when (i+1) % full_attention_interval == 0
  m.full_attention_interval = 4      # 3 Gated DeltaNet layers then 1 attention layer
  m.layer_types = ()                 # explicit per-layer types; () = derived from the interval
  m.num_attention_heads = 4          # query heads of the attention layers
  m.num_key_value_heads = 2          # GQA key/value heads
  m.head_dim = 16                    # attention head width
  m.partial_rotary_factor = 0.25     # share of head_dim that is rotated
  m.rope_theta = 10_000_000.0        # RoPE base
  m.linear_num_key_heads = 2         # Gated DeltaNet q/k heads
  m.linear_num_value_heads = 4       # Gated DeltaNet v heads (a multiple of the key heads)
  m.linear_key_head_dim = 16         # GDN q/k head width
  m.linear_value_head_dim = 16       # GDN v head width
  m.linear_conv_kernel_dim = 4       # causal depthwise conv kernel
  m.gdn_chunk_size = -1              # chunk length of the chunked delta rule; -1 = auto (32 on CPU, 64 elsewhere; docs/model.md)
  m.use_moe = True                   # sparse MoE (True) or a dense SwiGLU MLP (False)
  m.intermediate_size = 128          # dense MLP width (use_moe=False)
  m.num_experts = 8                  # routed experts
  m.num_experts_per_tok = 2          # top-k
  m.norm_topk_prob = True            # renormalise the top-k router weights
  m.moe_intermediate_size = 32       # routed expert width
  m.shared_expert_intermediate_size = 32  # shared expert width; 0 = no shared expert
  m.rms_norm_eps = 1e-6              # RMSNorm epsilon
  m.tie_word_embeddings = False      # LM head shares the embedding table
  m.max_position_embeddings = 4096   # context length the model is built for
  m.param_dtype = "float32"          # storage dtype of the weights
  m.dtype = "float32"                # activation / matmul dtype (bfloat16 on accelerators)
  m.initializer_range = 0.02         # std of the random init
  m.scan_layers = True               # scan over the repeating layer cycle (compile time flat in depth)
  m.remat = "none"                   # activation checkpointing per cycle: none | full
  m.attention_query_chunk = 0        # >0: attend in blocks of this many queries (memory O(chunk*seq)); 0 = one block
  m.attention_causal_block = -1      # >0: queries in blocks of this many, each scored only against the keys up to its end (~half the score work on long rows; with query chunks, a block is a map over its chunks); 0 = one block; -1 = auto (128 with the reference einsums, CPU's default; 8 blocks of whole query chunks under XLA's attention on longer rows; else 0; docs/model.md)
  m.logits_chunk = 0                 # >0: LM-head logits/logprobs for this many positions at a time; 0 = all
  m.gdn_backward = "custom"          # gradient of the GDN intra-chunk triangular solve: custom (hand-written VJP) | autodiff (reference)
  m.scan_unroll = -1                 # layer cycles per step of the layer scan; 0 = fully unrolled; -1 = auto (unrolled up to 2 cycles, 4 on a GPU, else 1; 1 under remat; docs/model.md)
  m.attention_impl = "auto"          # reference (einsums) | xla | cudnn (jax.nn.dot_product_attention) | pallas (JAX's Triton flash attention, GPU) | auto (per backend, docs/model.md)
  m.moe_dispatch = "auto"            # routed experts: ragged_dot | blocked (expert blocks, one batched matmul) | blocked_fused (blocked, each matmul one Triton kernel reading the experts in place: GPU; CPU interprets it; not TPU) | gmm (TPU grouped-matmul kernel) | auto (gmm on TPU where widths are multiples of 128, else blocked; docs/model.md)
  m.gdn_precision = "highest"        # chunked delta rule's float32 matmuls: highest (true float32; three TF32 passes in the gdn_scan=fused GPU kernels) | high (3 bf16 passes on TPU, TF32 on GPU) | default (one bf16 pass / TF32); the CPU runs float32 for all three
  m.decode_attention = "xla"         # a decode step's attention over the KV cache: xla (blocks of 2,048 positions up to the longest row, each copied out of the cache before use on GPU) | fused (one Triton kernel reading each row's blocks in place, up to its own length: GPU; CPU interprets it; not TPU; docs/model.md)
  m.gdn_decode = "xla"               # a decode step's Gated DeltaNet state update: xla (XLA's kernels read the state several times and copy the new one into the stack) | fused (one Triton kernel from the conv's outputs to the gated norm, reading and writing each state once, in place: GPU; CPU interprets it; not TPU; docs/model.md)
  m.gdn_scan = "outputs"             # chunked delta rule's scan over chunks: outputs (each chunk's output inside it, 4 matmuls a step) | states (only the state's recurrence, 2 matmuls a step; every chunk's output after it at once: fewer GPU kernels, slower on CPU) | fused (states, with each chunk's triangular solve, the recurrence and the outputs Triton kernels: GPU; CPU interprets them; not TPU; docs/model.md)
  m.gdn_storage_dtype = "float32"    # what gdn_scan=fused's kernels store between them (u, w, the per-chunk states, corrected values, outputs, their gradients): float32 | bfloat16 (as flash-linear-attention's kernels: half the bytes, each stored tensor rounded once; docs/model.md); they compute in float32 either way
  m.gdn_recompute = True             # the Gated DeltaNet mixer's float32 intermediates recomputed in the backward pass (memory); False keeps them: more memory, fewer bytes moved and kernels (docs/model.md)
  m.moe_expert_parallel = "auto"     # gmm and blocked dispatch on a mesh: on (tokens go to the devices holding their experts) | off (experts gathered whole to the tokens) | auto (on where the gathered tokens' rows are fewer than the experts' weights; docs/model.md)
  m.moe_block_size = 128             # blocked dispatch: rows per expert block (fewer when tokens per expert are fewer)
  m.moe_block_chunk = -1             # blocked dispatch: blocks a step of its matmul loop (each step gathers its blocks' expert matrices); 0 = all at once; -1 = auto (256 MiB of gathered weights a step; docs/model.md)
  return references.preset_defaults(m)


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.name = "base"                    # run name; outputs go to runs/<name>/
  c.seed = 0                         # master seed (init, data order, sampling)
  c.workdir = "runs"                 # parent directory of run outputs
  c.resume = "same"                  # a run directory holding a run of another config: same = refuse (keys safe to change excepted); changed = continue it with this config, the change recorded (rl/run_record.py)
  # XLA's persistent compilation cache: a later run (a sweep's next arm, make run again) reads
  # the executables an earlier one compiled instead of compiling them. "" = off.
  c.jax_cache_dir = "runs/jax_cache"
  c.jax_cache_min_compile_s = 1.0    # only compiles at least this long are written to it

  c.model = get_model_config()

  # Device mesh and logical-axis rules (see models/sharding.py).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.axes = ("data", "fsdp", "expert", "tensor")  # mesh axis names
  c.mesh.shape = (1, -1, 1, 1)       # one entry per axis; -1 = all remaining devices
  # Logical axis -> mesh axes. FSDP for weights, experts over `expert`, heads/MLP over `tensor`.
  c.mesh.rules = (
      ("batch", ("data", "fsdp", "expert")),
      ("activation_length", None),
      ("activation_embed", None),
      ("activation_heads", "tensor"),   # per-head activations of the sequence mixers (Gated DeltaNet; attention under context parallelism)
      ("activation_vocab", "tensor"),  # the LM head's logits, split by vocabulary (models/qwen3_5.py)
      ("vocab", "tensor"),
      ("heads", "tensor"),
      ("kv_heads", "tensor"),
      ("head_dim", None),
      ("q_heads_x_dim", "tensor"),
      ("kv_heads_x_dim", "tensor"),
      ("mlp", "tensor"),
      ("experts", "expert"),
      # Weights FSDP over `fsdp` x `expert`; an expert weight, whose experts took `expert` by
      # the rule above (flax assigns rules in order), over `fsdp` alone, the fallback rule.
      ("embed", ("fsdp", "expert")),
      ("embed", "fsdp"),
      ("expert_mlp", "tensor"),
      ("gdn_qkv", "tensor"),
      ("gdn_value", "tensor"),
      ("gdn_heads", "tensor"),
      ("conv_kernel", None),
      ("norm", None),
      ("layers", None),
      ("cycle", None),
  )

  # RL maths (rl/advantages.py, rl/policy_losses.py, rl/reductions.py). Defaults = the report's recipe.
  c.rl = ml_collections.ConfigDict()
  c.rl.advantage = "grpo"            # advantage estimator: grpo | rloo
  c.rl.grpo_norm_by_std = False      # GRPO: divide by the group std (the recipe does not)
  c.rl.advantage_eps = 1e-6          # added to the std when normalising
  c.rl.filter_zero_variance = True   # drop groups whose rewards are all equal (no signal)
  c.rl.policy_loss = "dppo_binary_tv"  # ppo | gspo | rollout_is | dppo_binary_tv
  c.rl.loss_reduction = "prompt_mean"  # token_mean | prompt_mean | sequence_mean | seq_mean_token_sum_norm
  c.rl.max_seq_len = 0               # constant of seq_mean_token_sum_norm; 0 = the batch's seq length
  c.rl.temperature = 1.0             # sampling temperature; logits are divided by it for logprobs
  c.rl.recompute_old_logprobs = False  # True: old logprobs = this step's params before any update
  c.rl.moe_aux_loss_coef = 0.0       # weight of the MoE load-balancing loss; 0 = off
  c.rl.ppo = ml_collections.ConfigDict()
  c.rl.ppo.eps_low = 0.2             # PPO ratio clip below 1
  c.rl.ppo.eps_high = 0.28           # PPO ratio clip above 1 (clip-higher)
  c.rl.ppo.dual_clip_c = 0.0         # dual clip constant (> 1, e.g. 3); 0 = off
  c.rl.gspo = ml_collections.ConfigDict()
  c.rl.gspo.eps_low = 3e-4           # GSPO sequence-ratio clip below 1
  c.rl.gspo.eps_high = 4e-4          # GSPO sequence-ratio clip above 1
  c.rl.rollout_is = ml_collections.ConfigDict()
  c.rl.rollout_is.eps_low = 0.5      # rollout_is: weight zeroed when pi/pi_rollout <= 1 - eps_low
  c.rl.rollout_is.eps_high = 4.0     # rollout_is: weight zeroed when pi/pi_rollout >= 1 + eps_high
  c.rl.dppo = ml_collections.ConfigDict()
  c.rl.dppo.delta_low = 0.15         # binary-TV: max drop of p(token) vs rollout on A <= 0
  c.rl.dppo.delta_high = 0.15        # binary-TV: max rise of p(token) vs rollout on A > 0
  c.rl.tis = ml_collections.ConfigDict()
  c.rl.tis.mode = "none"             # truncated IS vs rollout logprobs: none | token | sequence
  c.rl.tis.cap = 2.0                 # truncation of the TIS weight
  c.rl.kl = ml_collections.ConfigDict()
  c.rl.kl.coef = 0.0                 # KL-to-reference penalty weight; 0 = off (needs ref_logprobs)
  c.rl.kl.estimator = "k3"           # k1 | k3

  # Agent worlds, apps (MCP gateway), sandbox and tasks (envs/worlds, envs/apps, envs/tasks).
  c.envs = ml_collections.ConfigDict()
  c.envs.seed = 0                    # world/task generation seed (same seed -> identical bytes)
  c.envs.worlds_root = "runs/worlds"  # where rendered worlds are cached (rebuilt if settings change)
  c.envs.worlds_per_domain = 11      # 3 domains x 11 = 33 worlds, as in APEX-Agents
  c.envs.eval_worlds_per_domain = 3  # the first K worlds of each domain serve only the eval split
  c.envs.entities_per_world = 8      # companies / units / counterparties that tasks ask about
  c.envs.distractor_entities_per_world = 4  # same kinds of files, never asked about
  c.envs.people_per_world = 8        # colleagues with mailboxes and chat handles
  c.envs.note_files_per_world = 125  # cheap distractor files (drafts, notes, exports); ~166 files a world as in APEX
  c.envs.generation_workers = 2      # processes rendering worlds in parallel
  c.envs.train_tasks = 1928          # train split size (spread evenly over domains)
  c.envs.eval_tasks_per_domain = 160  # eval split = 3 x this
  c.envs.level_weights = (0.34, 0.33, 0.33)  # share of levels 1 / 2 / 3 among generated tasks
  c.envs.answer_rel_tol = 0.001      # relative tolerance of numeric answer criteria (on top of rounding)
  c.envs.max_numbers_in_answer = 8   # a final answer quoting more numbers fails numeric criteria
  # Where episodes' worlds and tasks come from (docs/own_environment.md).
  c.envs.source = "generated"        # generated (the rendered worlds) | mcp_stdio | mcp_http
  c.envs.tasks_file = ""             # JSONL task file or APEX-Agents/Archipelago task folder; "" = generated tasks
  c.envs.tasks_format = "auto"       # auto | jsonl | archipelago (how tasks_file is read)
  c.envs.mcp = ml_collections.ConfigDict()
  c.envs.mcp.command = ""            # mcp_stdio: server command line, started per world copy; {world} = its working dir
  c.envs.mcp.setup = ""              # mcp_stdio: shell command run in a fresh world copy before the server starts
  c.envs.mcp.env = ""                # mcp_stdio: extra environment, "K=V,K2=V2" (values may use {world})
  c.envs.mcp.url = ""                # mcp_http: streamable-HTTP URL of a running MCP server
  c.envs.mcp.reset = ""              # mcp_http: shell command (or http(s) URL, POSTed) run before each episode
  c.envs.mcp.headers_env = ""        # mcp_http: name of an environment variable holding "K: V" request headers
  # Judge model for `judge` rubric criteria (envs/judge.py).
  c.envs.judge = ml_collections.ConfigDict()
  c.envs.judge.endpoint = ""         # OpenAI-compatible base URL (.../v1); "" = none
  c.envs.judge.model = ""            # model name sent to the endpoint ("" = the server's first /v1/models entry)
  c.envs.judge.api_key_env = "OPENAI_API_KEY"  # environment variable holding the API key (never logged)
  c.envs.judge.checkpoint = ""       # a Hugging Face Qwen3.5 folder the project serves itself as judge
  c.envs.judge.timeout_s = 60.0      # one judge request
  c.envs.judge.retries = 2           # re-asks after a malformed verdict or a failed request
  c.envs.judge.max_concurrency = 4   # judge requests in flight per process
  c.envs.judge.rate_per_s = 0.0      # requests per second per process; 0 = unlimited
  c.envs.judge.max_file_chars = 8000  # changed/produced files shown to the judge, cut to this budget
  c.envs.judge.max_tokens = 256      # completion budget of one verdict
  c.envs.judge.cache_dir = ""        # verdict cache by content hash on disk; "" = in-memory only
  c.envs.tool_output_chars = 42_000  # tool results are cut to this many characters (server side; client side for envs.source=mcp_*)
  c.envs.tool_time_limit_s = 20.0    # server-side limit of one tool call (returns a tool error)
  c.envs.client_timeout_s = 60.0     # client-side read timeout of one MCP request
  c.envs.gateway_start_timeout_s = 60.0  # spawn + MCP handshake of a gateway process
  c.envs.sandbox = ml_collections.ConfigDict()
  c.envs.sandbox.wall_s = 10.0       # wall clock of one code run; the process group is killed after
  c.envs.sandbox.cpu_s = 8           # RLIMIT_CPU seconds
  c.envs.sandbox.memory_mb = 1024    # RLIMIT_AS of the sandboxed interpreter
  c.envs.sandbox.file_size_mb = 16   # RLIMIT_FSIZE: largest file a run may write
  c.envs.sandbox.open_files = 64     # RLIMIT_NOFILE
  c.envs.sandbox.max_processes = 32  # processes in the run's session before it counts as a fork bomb
  c.envs.sandbox.namespaces = True   # confine runs in their own root (user, mount, pid, net namespaces)
  c.envs.sandbox.allow_unconfined = False  # where no namespaces can be made: False refuses code execution; True runs it unconfined (reads anywhere), with a warning
  c.envs.sandbox.workspace_mb = 64   # tmpfs size of a run's /workspace (the world's files copied in, changes copied back)
  c.envs.sandbox.tmp_mb = 64         # tmpfs size of a run's private /tmp

  c.policy = "oracle"                # scripted policy for --mode=eval: oracle | null | model
  c.eval = ml_collections.ConfigDict()
  c.eval.split = "eval"              # split to evaluate: train | eval
  c.eval.max_tasks = 0               # evaluate only the first N tasks of the split; 0 = all
  c.eval.concurrency = 4             # concurrent episodes (one gateway process each)
  c.eval.transport = "mcp"           # mcp = real stdio MCP gateways; local = in-process tools (grading logic only)

  # Optimizer (optax AdamW).
  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adamw"             # RL optimizer: adamw | sgd (momentum b1; rl/train_step.py says why)
  c.optim.lr = 1e-6                  # peak learning rate
  c.optim.b1 = 0.9                   # Adam beta1
  c.optim.b2 = 0.98                  # Adam beta2
  c.optim.eps = 1e-8                 # Adam epsilon
  c.optim.weight_decay = 0.01        # decoupled weight decay
  c.optim.grad_clip = 1.0            # clip by global norm; 0 = off
  c.optim.warmup_steps = 0           # linear warmup from 0 to lr
  c.optim.schedule = "constant"      # after warmup: constant | cosine
  c.optim.decay_steps = 0            # cosine length after warmup; 0 = train.steps - warmup
  c.optim.min_lr_ratio = 0.0         # cosine floor as a fraction of lr
  c.optim.mu_dtype = "float32"       # dtype of Adam's first moment
  c.optim.trainable = ""             # RL updates only params whose path ('blocks/3/input_norm', 'final_norm') re.search-matches; "" = all

  # Low-rank adapters (models/lora.py, docs/lora.md): with lora.rank > 0, RL trains only
  # adapters W + (alpha / rank) A @ B on a frozen base (no base gradients or optimizer state).
  c.lora = ml_collections.ConfigDict()
  c.lora.rank = 0                    # adapter rank r; 0 = off (RL trains the base's params, optim.trainable)
  c.lora.alpha = 32.0                # the update is scaled by alpha / rank
  c.lora.targets = (                 # regexes re.search-matched against param paths ('blocks/0/mixer/q_proj'), each matching some projection; the router only if named
      r"(mixer/(q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|out_proj)"
      r"|ffn/(shared_)?(gate_proj|up_proj|down_proj)|ffn/(wi_gate|wi_up|wo))$",
  )
  c.lora.export_dir = ""             # --mode=rl's end writes <dir>/adapter (PEFT layout), <dir>/merged (and <dir>/base when the base has no Hugging Face directory); "" = none (rl/lora_export.py)

  # Training loop shape.
  c.train = ml_collections.ConfigDict()
  c.train.steps = 100                # optimizer steps of the run
  c.train.prompts_per_step = 16      # prompt groups per rollout batch
  c.train.samples_per_prompt = 16    # samples per prompt (group size)
  c.train.max_draws = 1              # dynamic sampling: draws of prompts_per_step tasks a step until
                                     # that many groups carry signal (not all pass / all fail); 1 = off
  c.train.mini_batches = 1           # optimizer updates per rollout batch (1 = on-policy)
  c.train.micro_batches = 1          # gradient-accumulation splits of a mini-batch (lax.scan); fewer run where a split would give the devices splitting the rows unequal shares (TrainStep.micro_batches)
  c.train.skip_empty_updates = True  # no optimizer update (momentum, decay) for a mini-batch without a loss token
  c.train.seq_buckets = ()           # shorter row lengths a step pads to when its longest trajectory fits (one compile each); () = seq_len only
  c.train.max_context = 4096         # longest episode (tokens) the harness lets grow; recipe: 160k (report_recipe.py)
  c.train.seq_len = references.follows(c.train, "max_context")  # padded token length of a training row (>= max_context); default = train.max_context
  c.train.log_every = 1              # steps between metric logs
  c.train.init_from = ""             # Hugging Face checkpoint directory the policy starts from (SFT, else RL); "" = random init
  c.train.xla_cpu_dots = "eigen"     # XLA:CPU's matmul library for the RL and SFT steps: eigen | ynnpack (XLA's default; decode keeps it); models/xla_flags.py

  # Checkpoints (orbax CheckpointManager).
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.dir = ""              # "" = <workdir>/<name>/checkpoints
  c.checkpoint.save_every = 50       # steps between saves; 0 = never
  c.checkpoint.keep = 3              # keep the last K checkpoints
  c.checkpoint.async_save = True     # write in a background thread

  # Memory plan (--mode=plan, rl/plan.py): shapes only, nothing allocated.
  c.plan = ml_collections.ConfigDict()
  c.plan.num_devices = 0             # devices of the target slice; 0 = the devices present
  c.plan.num_processes = 0           # hosts (processes) of the target job; 0 = this job's
  c.plan.device_kind = "cpu"         # label of the target device (e.g. H200, TPU v5p)
  c.plan.device_memory_gib = 16.0    # memory per device the plan must fit in
  c.plan.seq_lens = ()               # sequence lengths tabulated; () = train.seq_len only

  # Ahead-of-time compile for an accelerator slice (--mode=compile, rl/compile_job.py): every
  # program the job runs there, compiled from this CPU for compile-only devices; nothing runs.
  c.compile = ml_collections.ConfigDict()
  c.compile.target = ""              # KIND:SHAPE, e.g. v5p:4x4x4 (TPU chips) or h200:2x8 (hosts x GPUs); "" = required
  c.compile.programs = ("rl_step", "sft_step", "engine")  # which of the job's programs (sft_step only where sft.steps > 0)
  c.compile.seq_len = 0              # row length of the compiled train step; 0 = train.seq_len
  c.compile.engine_buckets = ()      # prefill buckets compiled; () = the largest of rollout.prefill_buckets
  c.compile.engine_devices = 0       # devices of the serve job's engine; 0 = one host's (rollout.mesh_shape decides)
  c.compile.kernel_lines = 0         # GPU targets: print the N source lines whose kernels take longest by the roofline estimate

  # Tokenizer and chat format (envs/chat).
  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.path = ""              # tokenizer.json or a directory holding one; "" = the shipped tiny BPE
  c.tokenizer.special_ids = "tiny"   # control-id table checked at load: tiny | qwen3_5 | auto (read from the checkpoint's tokenizer files)
  c.tokenizer.thinking = True        # generation prompt opens a think block (False: empty think block)

  # Agent harness (envs/harness): one agent loop per process, a timeout on everything.
  c.harness = ml_collections.ConfigDict()
  c.harness.style = "mcp"            # mcp (the app tools) | shell (bash, read, write, edit, glob, grep over the world's folder)
  c.harness.num_workers = 2          # agent-loop processes in the pool (concurrent episodes)
  c.harness.max_turns = 100          # assistant turns per episode before max_turns
  c.harness.max_tokens_per_turn = 512  # max_tokens of one model call (capped by the context left)
  # The context limit is train.max_context; sampling: rl.temperature, rollout.top_p / top_k.
  c.harness.repair_attempts = 2      # repair messages per episode for malformed / unknown tool calls
  c.harness.nudge = True             # context nudge: ask for a final answer when the context runs low
  c.harness.nudge_fraction = 0.2     # nudge when context left for the next turn <= this share of max
  c.harness.nudge_once = True        # at most one nudge per episode
  c.harness.world_start_timeout_s = 90.0  # outer bound on starting a world (>= envs.gateway_start_timeout_s)
  c.harness.model_timeout_s = 120.0  # one policy.generate call
  c.harness.tool_timeout_s = 30.0    # one tool call through the gateway
  c.harness.grade_timeout_s = 60.0   # grading an episode
  c.harness.episode_timeout_s = 900.0  # a whole episode, start to grade
  c.harness.kill_grace_s = 10.0      # past the episode timeout, the pool kills the process
  c.harness.max_world_starts = -1    # worlds (gateway processes) starting at once across the pool; 0 = no limit, -1 = 2 per CPU core
  c.harness.start_method = "forkserver"  # agent processes: forkserver (preloaded, cheap) | spawn
  c.harness.preload = ("envs.harness.episodes", "envs.harness.oracle", "envs.apps.gateway", "envs.tasks")  # imported once by the fork server
  c.harness.max_timeouts_per_group = 1  # a group with more timed-out trajectories is masked whole
  c.harness.policy_backend = "jetstream"  # policy=model: jetstream (server at rollout.address) | local (in-process decode)

  # Rollout serving: the JetStream engine, server and token client (rl/rollout).
  c.rollout = ml_collections.ConfigDict()
  c.rollout.port = 9000              # gRPC port of the JetStream server (launch.py --port overrides)
  c.rollout.address = "localhost:9000"  # where the token client finds the server
  # Rollout servers run as separate jobs (launch.py --mode=serve on their own hosts / slices):
  # the RL loop sends rollouts to them and publishes each step's weights under weights_dir,
  # which they watch (rl/rollout/published_weights.py). () = one server in the trainer's process.
  c.rollout.servers = ()             # "host:port" of each; requests go round-robin over them
  c.rollout.weights_dir = ""         # where weights are published (shared storage); serve mode watches it
  c.rollout.weights_keep = 2         # published versions kept
  c.rollout.weights_poll_s = 0.5     # how often servers look for, and the trainer probes for, a version
  c.rollout.sync_timeout_s = 600.0   # the trainer's wait for every server to serve a published version
  c.rollout.mesh_shape = ()          # the engine's mesh over mesh.axes and mesh.rules; () = mesh.shape (the trainer's devices)
  c.rollout.whole_weights = False    # every weight but the routed experts (and router) whole on each engine device: no per-step all-gather, fewer slots; False = split as mesh.rules split the trainer's (docs/rollout.md)
  c.rollout.slots = 0                # decode slots (max_concurrent_decodes); 0 = capacity planner, capped at max_slots
  c.rollout.max_slots = 32           # cap on planner-derived slots (the planner sees no activations)
  c.rollout.max_len = references.follows(c.train, "max_context")  # tokens per slot (prompt + sampled), the KV cache length; default = train.max_context
  c.rollout.prefill_buckets = (64, 128, 256, 512, 1024, 2048, 4096)  # prompt pad lengths (one compile each)
  c.rollout.prefix_cache = True      # prefill the prompt prefix all requests share (system turn) once per weights
  c.rollout.prefix_buckets = (64, 128, 256, 512, 1024, 2048, 4096)  # pad lengths of the rest of a prompt after it
  c.rollout.prefix_min_len = 256     # shortest shared prefix worth caching (tokens)
  c.rollout.turn_cache = 0           # finished turns whose state the conversation's next prompt continues from; 0 = off
  c.rollout.stop_ids = (2, 0)        # default stop ids: <|im_end|>, <|endoftext|> (tiny vocab; qwen3_5: 248046, 248044)
  c.rollout.temperature = 1.0        # default sampling temperature; 0 = greedy
  c.rollout.top_p = 1.0              # default nucleus mass; 1.0 = off
  c.rollout.top_k = 0                # default top-k; 0 = off
  c.rollout.seed = 0                 # sampler seed of requests that bring none
  c.rollout.cache_dtype = ""         # KV / conv cache dtype; "" = model.dtype
  c.rollout.weights_dtype = ""       # dtype of the served weight matrices (vectors keep theirs); "" = model.param_dtype
  c.rollout.sampler_choice = "host"  # host: the engine picks the sampler's kind (greedy / draw / filter) from the slots' settings, a generate program each; device: one program choosing by lax.cond, which XLA:GPU runs as a host wait each step (rl/rollout/README.md, sampling)
  c.rollout.scan_layers = True       # the engine holds the layers stacked, as trained, and scans them; False = one by one, run as the model with scan_layers=False: decode reads weights in place (no slice copies), compile time grows with depth (docs/rollout.md)
  c.rollout.fuse_projections = True  # the engine holds each Gated DeltaNet layer's four input projections as one matrix: one matmul a step (XLA:GPU otherwise concatenated the four every step); False = as trained (docs/rollout.md)
  c.rollout.warmup = True            # compile every prefill bucket before serving
  c.rollout.rpc_threads = 0          # gRPC handler threads; 0 = max(slots, 64)
  c.rollout.client_timeout_s = 600.0  # token client's deadline for one generate call
  c.rollout.log_level = "WARNING"    # root log level once JetStream is imported (it forces DEBUG)
  # Capacity planner (rl/rollout/capacity.py): per-sequence decode state vs device memory.
  c.rollout.capacity = ml_collections.ConfigDict()
  c.rollout.capacity.device_memory_gib = 0.0  # memory of one accelerator; 0 = plan.device_memory_gib
  c.rollout.capacity.devices_per_engine = 0  # accelerators serving one engine; 0 = its mesh's (rollout.mesh_shape)
  c.rollout.capacity.tensor_parallel = 1  # TP degree inside an engine (KV heads replicate past kv_heads)
  c.rollout.capacity.memory_fraction = 0.9  # share of device memory the engine may use
  c.rollout.capacity.num_engines = 1  # engines (replicas) serving rollouts
  c.rollout.capacity.context_len = 0  # tokens per sequence to plan for; 0 = rollout.max_len
  c.rollout.capacity.weight_bytes = 0  # bytes per weight; 0 = from rollout.weights_dtype (or model.param_dtype)
  c.rollout.capacity.cache_bytes = 0  # bytes per KV / conv element; 0 = from cache_dtype / model.dtype
  c.rollout.capacity.reserve_gib = 0.0  # per-engine workspace held back (activations, compiler scratch)

  # SFT warm start (rl/sft.py, --mode=sft): the oracle's trajectories, loss on assistant tokens.
  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 0                    # optimizer steps of the warm start; 0 = no SFT before RL
  c.sft.batch_size = 8               # trajectories per SFT step
  c.sft.micro_batches = 1            # a step's rows in this many sequential micro-batches, gradients summed (memory; same loss and gradient)
  c.sft.lr = 1e-5                    # peak learning rate (AdamW whatever optim.name; other optim.* knobs shared)
  c.sft.warmup_steps = 10            # linear warmup, then sft.schedule
  c.sft.schedule = "cosine"          # after warmup: cosine (to 10% of lr) | constant
  c.sft.max_tasks = 0                # oracle trajectories collected from the first N train tasks; 0 = all
  c.sft.levels = (1, 2, 3)           # task levels of the SFT data
  c.sft.dir = ""                     # SFT checkpoint directory; "" = <workdir>/<name>/sft (sweeps share one)
  c.sft.lm_loss_weight = 0.0         # + this x next-token loss on every trajectory token (tool output too); 0 = assistant tokens only
  c.sft.export_hf = ""               # also write the SFT result as a Hugging Face checkpoint here ("" = no)
  c.sft.pad_multiple = 512           # a batch is cut to its longest row rounded up to this (few compiled shapes); 0 = longest of the data
  c.sft.eval_every = 0               # steps between held-out figures (teacher-forced, eval-split oracle trajectories); 0 = never
  c.sft.eval_tasks = 48              # eval-split tasks of those figures (spread over the split)
  c.sft.copy_drill_rows = 0          # + synthetic copy rows per step (rl.sft.copy_drill_batch); 0 = none
  c.sft.copy_drill_len = 32          # tokens copied per drill row
  c.sft.copy_drill_row_len = 256     # drill row length; segment and copy at random places in it (<= 2x len: fixed offset)
  c.sft.copy_drill_weight = 1.0      # weight of the drill loss in the SFT loss
  c.sft.copy_drill_only_steps = 0    # the first N of sft.steps train on the drill rows alone (cheap steps; no trajectories)
  c.sft.save_every = 0               # steps between SFT saves (orbax, and export_hf when set); 0 = at the end only

  # The RL loop (rl/learner.py, --mode=rl): rollouts -> train step -> weight sync -> eval.
  c.loop = ml_collections.ConfigDict()
  c.loop.levels = (1, 2, 3)          # task levels sampled for training (train split)
  c.loop.families = ()               # task families sampled for training; () = all (eval: always all)
  c.loop.train_pass_rates = ""       # JSON of train tasks' pass rates under the starting policy (--mode=pass_rates writes it)
  c.loop.train_pass_range = ()       # (lo, hi): train only on tasks whose measured rate r has lo <= r <= hi; () = all
  c.loop.pass_rate_samples = 4       # --mode=pass_rates: rollouts per train task
  c.loop.pass_rate_max_tasks = 0     # --mode=pass_rates: the first N train tasks; 0 = all
  c.loop.tools = ()                  # tools shown to the policy; () = every tool of the world
  c.loop.tool_schema = "full"        # tool JSON in the system turn: full (as served) | compact (name + required params)
  c.loop.sft_first = True            # --mode=rl starts from the SFT checkpoint, training it first if missing
  c.loop.max_staleness = 0           # 0 = synchronous; k >= 1 = next k steps' rollouts drawn while training (rl/rollout/prefetch.py)
  c.loop.eval_every = 0              # RL steps between held-out evals; 0 = only before and after RL
  c.loop.eval_levels = (1, 2, 3)     # task levels of the held-out eval (eval split)
  c.loop.eval_max_tasks = 0          # held-out eval on the first N tasks of those levels; 0 = all
  c.loop.eval_styles = ()            # harness styles the held-out evals also run under (besides harness.style), e.g. ("mcp", "shell"): summary.json by_style
  c.loop.eval_samples = 1            # samples per eval task (pass@1 averages over them)
  c.loop.eval_temperature = -1.0     # sampling temperature of the held-out eval; < 0 = rl.temperature, 0 = greedy
  c.loop.bootstrap = 2000            # bootstrap resamples of the 95% intervals
  c.loop.progress = True             # tqdm progress bars with ETA on the console
  c.loop.tensorboard = True          # also write metrics as TensorBoard events (JSONL always)

  # One job over many processes (rl/distributed.py): every host runs the same command; JAX reads
  # its peers from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (or a TPU / SLURM
  # environment). scripts/local_pod.py starts such a job on one machine.
  c.distributed = ml_collections.ConfigDict()
  c.distributed.heartbeat_timeout_s = 30   # a process silent this long is dead: every other one stops with an error
  c.distributed.init_timeout_s = 300       # how long the processes wait for each other at start
  c.distributed.exchange_timeout_s = 3600  # how long a process waits for its peers' share of a step (rollouts, evals)
  c.distributed.cpu_collectives = "gloo"   # collectives between processes on the CPU backend (fake devices, tests)
  return c
