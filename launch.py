"""One entry point: --mode = model | sft | rl | eval | serve | plan | pass_rates | compile.

  python launch.py --config=configs/tiny_cpu.py --config.model.hidden_size=128 --mode=model
  python launch.py --config=configs/tiny_cpu.py --mode=rl            # SFT warm start, then RL
  python launch.py --config=configs/tiny_cpu.py --mode=rl --sweep=configs/sweeps/loss_reduction.py [--dry_run]
  python launch.py --config=configs/tiny_cpu.py --mode=pass_rates   # train tasks' pass rates, for loop.train_pass_range
  python launch.py --config=configs/qwen3_5_35b_a3b.py --mode=compile --config.compile.target=v5p:2x2x4  # AOT for a slice

Configs are ml_collections files with a `get_config(arg)`; any field can be overridden from the
command line. A config error (an unknown key, a value of the wrong type or out of range, a file
the mode reads that is not there) ends in one line on stderr naming the key, exit code 2; the
traceback with --verbose (configs/validate.py). Every override takes effect: a preset
gives defaults, derived values follow their source (configs/references.py), and every mode
first prints the resolved model and the keys that differ from configs/base.py (configs/record.py).
A run directory holds one run: --mode=rl and --mode=sft record the config there and refuse a
later launch with another one before writing anything, unless only keys safe to change on
resume differ or --config.resume=changed accepts the change (rl/run_record.py).
"""
import importlib
import os
import sys
import traceback

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

from configs import record
from configs import validate
from configs.validate import ConfigError
from rl import distributed
from rl import run_record
from rl import sweep

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/tiny_cpu.py", "Config file, optionally with `:arg`.", lock_config=True)
_MODE = flags.DEFINE_enum(
    "mode", "model", ["model", "sft", "rl", "eval", "serve", "plan", "pass_rates", "compile"],
    "What to run.")
_PORT = flags.DEFINE_integer("port", 9000, "gRPC port for --mode=serve.")
_HTTP_PORT = flags.DEFINE_integer(
    "http_port", None, "With --mode=serve: also serve the OpenAI-compatible HTTP API "
    "(/v1/completions, /v1/chat/completions, /v1/models) on this port, beside gRPC "
    "(docs/openai_endpoint.md).")
_WEIGHTS = flags.DEFINE_string(
    "weights", "", "With --mode=serve: what to serve: '' = the config's checkpoint "
    "(train.init_from), DIR = that Hugging Face checkpoint, 'random' = the seeded random init.")
_SWEEP = flags.DEFINE_string(
    "sweep", None, "Sweep file (configs/sweeps/X.py[:arg]) whose get_sweep() lists override "
    "dicts: runs --mode once per dict, then writes a comparison table.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "With --sweep: print the jobs and what each resolves to, run nothing.")
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "A config error with its traceback (default: one line naming the key).")

# mode -> "module:function"; each takes (config, flags) and is imported lazily so that a
# mode's heavy dependencies (JetStream, worlds) load only when that mode runs.
_MODES = {
    "model": "models.inspect_cli:main",
    "plan": "rl.plan:main",
    "eval": "rl.evaluation:main_eval",
    "serve": "rl.rollout.serve:main",
    "sft": "rl.sft:main_sft",
    "rl": "rl.learner:main_rl",
    "pass_rates": "rl.pass_rates:main",
    "compile": "rl.compile_job:main",
}


def _use_compilation_cache(config):
  """Points XLA's persistent compilation cache at config.jax_cache_dir (before any compile)."""
  if not config.jax_cache_dir:
    return
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(config.jax_cache_dir))
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(config.jax_cache_min_compile_s))


def _verbose_asked(argv) -> bool:
  """--verbose on `argv`, read from the words themselves: a parse that failed has set no flag."""
  asked = False
  for a in argv[1:]:
    if a in ("--verbose", "--verbose=true", "--verbose=True", "--verbose=1"):
      asked = True
    elif a in ("--noverbose", "--verbose=false", "--verbose=False", "--verbose=0"):
      asked = False
  return asked


def _config_error(message: str, error: BaseException, verbose: bool):
  """A config error: its traceback only with --verbose, then one line; exit code 2."""
  if verbose:
    traceback.print_exception(error)
  sys.stderr.write(f"launch.py: {message}\n")
  sys.exit(2)


def _parse_flags(argv):
  """absl's flag parsing (app.run's default) with every error it meets -- an unknown config
  key, a value of the wrong type, a config file that does not load or whose get_config raises,
  an unknown flag -- said in one line (configs/validate.parse_error_line), exit code 2."""
  try:
    rest = flags.FLAGS(argv)
    _CONFIG.value.keys()   # a config file that failed to load raises only when read
    return rest
  except Exception as e:  # pylint: disable=broad-except
    _config_error(validate.parse_error_line(e, argv), e, _verbose_asked(argv))


def main(argv):
  try:
    _main(argv)
  except ConfigError as e:
    # Said in its own words, no traceback: the command line or the run directory is at fault.
    _config_error(str(e), e, _VERBOSE.value)


def _main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Counts out of range, batches that do not split, files the mode reads that are not there.
  validate.check(_CONFIG.value, _MODE.value)
  if _SWEEP.value:
    sweep.run_sweep(_SWEEP.value, _CONFIG.value, _MODE.value, sys.argv, dry_run=_DRY_RUN.value)
    return
  # On a pod every host runs this same command; JAX learns its peers from the environment.
  distributed.initialize(_CONFIG.value)
  distributed.check_same_run(_CONFIG.value)
  if not distributed.is_writer():
    # Process 0 speaks for the job; the others' errors still reach stderr.
    sys.stdout = open(os.devnull, "w", encoding="utf-8")
  _use_compilation_cache(_CONFIG.value)
  print(record.report(_CONFIG.value), flush=True)   # the resolved config, before anything runs
  # A run directory holds one run: refuse another config before anything is written there.
  run_record.guard(_CONFIG.value, _MODE.value)
  module_name, fn_name = _MODES[_MODE.value].split(":")
  getattr(importlib.import_module(module_name), fn_name)(_CONFIG.value, flags.FLAGS)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  app.run(main, flags_parser=_parse_flags)
