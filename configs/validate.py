"""Checks a config can run before anything runs, each failure one line naming the key.

launch.py calls `check(config, mode)` first thing and prints a `ConfigError` as one line on
stderr (no traceback unless --verbose) with exit code 2, as it does for an unknown key or a
value of the wrong type on the command line (those ml_collections and absl find while the flags
are parsed). The checks here are the cheap ones: counts that cannot be negative or zero, a
rollout batch that must split into mini- and micro-batches, tuples that must hold integers, and
files or directories the mode reads that are not there. Deeper code keeps its own checks (a
model shape that does not match a checkpoint, a pass-rate file of other tasks); these only
make the common mistakes say so at once.
"""
import os
import re


class ConfigError(ValueError):
  """A config (or command line) that cannot run; launch.py prints its message without a
  traceback and exits with code 2. The checks here say it in one line naming the key."""


# Counts that may be 0 (0 = off / all / none, as configs/base.py says) but not negative.
NON_NEGATIVE = ("train.steps", "sft.steps", "checkpoint.save_every", "checkpoint.keep",
                "loop.eval_every", "loop.max_staleness", "loop.eval_max_tasks",
                "sft.save_every", "sft.eval_every", "sft.max_tasks", "eval.max_tasks",
                "rollout.slots", "optim.warmup_steps", "optim.decay_steps", "sft.warmup_steps",
                "optim.lr", "sft.lr", "optim.weight_decay", "optim.grad_clip",
                "envs.train_tasks", "envs.eval_tasks_per_domain")
# Counts that must be at least 1.
POSITIVE = ("train.prompts_per_step", "train.samples_per_prompt", "train.mini_batches",
            "train.micro_batches", "train.max_draws", "train.max_context", "train.seq_len",
            "sft.batch_size", "sft.micro_batches", "harness.num_workers", "harness.max_turns",
            "harness.max_tokens_per_turn", "loop.eval_samples", "eval.concurrency",
            "rollout.max_slots", "rollout.max_len")
# Tuples whose entries are integers (ml_collections parses `--config.k=abc` on a tuple field
# as the tuple ('abc',) and cannot know the entries' type).
INT_TUPLES = ("train.seq_buckets", "rollout.prefill_buckets", "rollout.prefix_buckets",
              "rollout.stop_ids", "rollout.mesh_shape", "mesh.shape", "plan.seq_lens",
              "compile.engine_buckets", "sft.levels", "loop.levels", "loop.eval_levels")
# --config.resume: what launch.py does when the run directory holds a run of another config
# (rl/run_record.py).
RESUME = ("same", "changed")
# rollout.sampler_choice: where the engine's sampler picks its kind (rl/rollout/engine.py).
SAMPLER_CHOICES = ("host", "device")

# Modes that read each file or directory (set = must exist).
_READS_INIT_FROM = ("rl", "sft", "pass_rates")
_READS_TASKS = ("rl", "sft", "eval", "pass_rates")
_TOKENIZES = ("rl", "sft", "eval", "pass_rates", "serve")


def get(config, key: str):
  """`config` at the dotted `key`."""
  node = config
  for part in key.split("."):
    node = node[part]
  return node


def _shown(v) -> str:
  return repr(tuple(v)) if isinstance(v, (tuple, list)) else repr(v)


def check_values(config, mode: str) -> None:
  """Raises ConfigError at the first count out of range, tuple of non-integers or rollout
  batch that does not split, naming the key, its value and what it must be."""
  for key in NON_NEGATIVE:
    v = get(config, key)
    if v < 0:
      raise ConfigError(f"{key}={v}: must be >= 0")
  for key in POSITIVE:
    v = get(config, key)
    if v < 1:
      raise ConfigError(f"{key}={v}: must be >= 1")
  for key in INT_TUPLES:
    v = get(config, key)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
      raise ConfigError(f"{key}={_shown(v)}: must be a tuple of integers, e.g. (1024,2048)")
  if config.resume not in RESUME:
    raise ConfigError(f"resume={config.resume!r}: must be one of {' | '.join(RESUME)} "
                      "(docs/training.md, \"Checkpoints and resume\")")
  if config.rollout.sampler_choice not in SAMPLER_CHOICES:
    raise ConfigError(f"rollout.sampler_choice={config.rollout.sampler_choice!r}: must be one of "
                      f"{' | '.join(SAMPLER_CHOICES)} (rl/rollout/README.md, sampling)")
  if mode == "rl":
    check_batch_split(config)


def check_batch_split(config) -> None:
  """A step's rollout batch must split into train.mini_batches x train.micro_batches (also
  checked by rl.batch.check_batch_shape, for runs started without launch.py)."""
  t = config.train
  rows = int(t.prompts_per_step) * int(t.samples_per_prompt)
  parts = int(t.mini_batches) * int(t.micro_batches)
  if parts < 1 or rows % parts:
    raise ConfigError(
        f"train.micro_batches={t.micro_batches}: train.prompts_per_step x "
        f"train.samples_per_prompt = {rows} rows do not split into train.mini_batches x "
        f"train.micro_batches = {t.mini_batches} x {t.micro_batches}")


def check_files(config, mode: str) -> None:
  """Raises ConfigError when a file or directory `mode` reads is set but not there."""
  init_from = config.train.init_from
  if mode in _READS_INIT_FROM and init_from and not os.path.isdir(init_from):
    raise ConfigError(f"train.init_from={init_from!r}: no such directory (a Hugging Face "
                      "checkpoint directory; \"\" = random init)")
  tasks_file = config.envs.tasks_file
  if mode in _READS_TASKS and tasks_file and not os.path.exists(tasks_file):
    raise ConfigError(f"envs.tasks_file={tasks_file!r}: no such file or directory (a JSONL "
                      "task file or an APEX-Agents task folder; \"\" = generated tasks)")
  tok = config.tokenizer.path
  if mode in _TOKENIZES and tok and not os.path.exists(tok):
    raise ConfigError(f"tokenizer.path={tok!r}: no such file or directory (tokenizer.json or a "
                      "directory holding one; \"\" = the shipped tiny tokenizer)")
  judge = config.envs.judge.checkpoint
  if mode in _READS_TASKS and judge and not os.path.isdir(judge):
    raise ConfigError(f"envs.judge.checkpoint={judge!r}: no such directory")
  rates = config.loop.train_pass_rates
  if mode == "pass_rates" and not rates:
    raise ConfigError("loop.train_pass_rates is empty: --mode=pass_rates writes "
                      "config.loop.train_pass_rates, set it to a path")
  if mode == "rl" and tuple(config.loop.train_pass_range):
    if not rates:
      raise ConfigError("loop.train_pass_range is set but loop.train_pass_rates names no file")
    if not os.path.isfile(rates):
      raise ConfigError(f"loop.train_pass_rates={rates!r}: no such file (--mode=pass_rates "
                        "writes it)")


def check(config, mode: str) -> None:
  """Everything above: values, then files."""
  check_values(config, mode)
  check_files(config, mode)


# -- errors met while the command line is parsed -----------------------------------------------

_UNKNOWN = re.compile(r"\\?'([A-Za-z0-9_]+)\\?'")
_DID_YOU_MEAN = re.compile(r'Did you mean "([^"]+)" instead of "([^"]+)"\?')
_REWORDED = (
    (re.compile(r"invalid literal for int\(\) with base 10: (.*)$"), r"not an integer: \1"),
    (re.compile(r"could not convert string to float: (.*)$"), r"not a number: \1"))


def _config_flag(argv) -> str:
  """The --config=<file>[:arg] of `argv` (the last one), or "" when there is none."""
  values = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")]
  return values[-1] if values else ""


def _overridden_keys(argv) -> list:
  """The dotted keys of `argv`'s --config.<key>=<value> (or --config.<key> <value>) flags."""
  return [a[len("--config."):].split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]


def _last_line(text: str) -> str:
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  return lines[-1] if lines else ""


def parse_error_line(error: BaseException, argv: list) -> str:
  """One line for an error met while parsing `argv` with absl and ml_collections' config flags:
  an unknown key (with ml_collections' suggestion, as a whole dotted key), a value of the wrong
  type, a config file that does not load or whose get_config raises, an unknown flag."""
  text = str(error)
  if isinstance(error, (KeyError, AttributeError)):
    # ml_collections: "'stepz'\nDid you mean "steps" instead of "stepz"?" (escaped once more
    # when an AttributeError wraps the KeyError).
    m = _UNKNOWN.search(text)
    if m:
      segment = m.group(1)
      keys = [k for k in _overridden_keys(argv) if segment in k.split(".")]
      key = keys[0] if keys else segment
      line = f"--config.{key}: unknown config key"
      hint = _DID_YOU_MEAN.search(text)
      if hint and hint.group(2) == segment:
        parts = key.split(".")
        parts[parts.index(segment) if segment in parts else -1] = hint.group(1)
        line += f" (did you mean {'.'.join(parts)}?)"
      return line
  if isinstance(error, OSError) and "Failed loading config file" in text:
    return f"--config={_config_flag(argv)}: cannot load the config file ({_last_line(text)})"
  if "Error whilst parsing config file" in text:
    # A config file's get_config raised; absl carries its traceback in the message.
    flag = text.split(": Error whilst parsing config file", 1)[0].removeprefix("flag ")
    return f"{flag}: {_last_line(text)}"
  line = " ".join(text.split()).removeprefix("flag ")
  for pattern, repl in _REWORDED:
    line = pattern.sub(repl, line)
  if isinstance(error, (KeyError, AttributeError, TypeError, NameError, SyntaxError,
                        ImportError)) or not line:
    line = f"{type(error).__name__}: {line}"
    if _config_flag(argv):
      line = f"--config={_config_flag(argv)}: {line}"
  return line
