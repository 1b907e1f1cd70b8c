"""One entry point: --mode = model | sft | rl | eval | serve | plan | pass_rates | compile.

  python launch.py --config=configs/tiny_cpu.py --config.model.hidden_size=128 --mode=model
  python launch.py --config=configs/tiny_cpu.py --mode=rl            # SFT warm start, then RL
  python launch.py --config=configs/tiny_cpu.py --mode=rl --sweep=configs/sweeps/loss_reduction.py [--dry_run]
  python launch.py --config=configs/tiny_cpu.py --mode=pass_rates   # train tasks' pass rates, for loop.train_pass_range
  python launch.py --config=configs/qwen3_5_35b_a3b.py --mode=compile --config.compile.target=v5p:2x2x4  # AOT for a slice

Configs are ml_collections files with a `get_config(arg)`; any field can be overridden from the
command line, and an unknown key is an error naming it. Every override takes effect: a preset
gives defaults, derived values follow their source (configs/references.py), and every mode
first prints the resolved model and the keys that differ from configs/base.py (configs/record.py).
A run directory holds one run: --mode=rl and --mode=sft record the config there and refuse a
later launch with another one before writing anything, unless only keys safe to change on
resume differ or --config.resume=changed accepts the change (rl/run_record.py).
"""
import importlib
import os
import sys

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

from configs import record
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
_SWEEP = flags.DEFINE_string(
    "sweep", None, "Sweep file (configs/sweeps/X.py[:arg]) whose get_sweep() lists override "
    "dicts: runs --mode once per dict, then writes a comparison table.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "With --sweep: print the jobs and what each resolves to, run nothing.")

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


def main(argv):
  try:
    _main(argv)
  except ConfigError as e:
    # Said in its own words, no traceback: the command line or the run directory is at fault.
    sys.stderr.write(f"launch.py: {e}\n")
    sys.exit(2)


def _main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
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
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and module_name.startswith(e.name):
      sys.exit(f"--mode={_MODE.value} is not available yet in this checkout ({module_name} missing)")
    raise
  getattr(module, fn_name)(_CONFIG.value, flags.FLAGS)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  app.run(main)
