"""launch.py as a user runs it."""
import ast
import os
import re
import subprocess
import sys

import pytest

from configs import qwen3_5_35b_a3b
from models import qwen3_5

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_mode_names_a_function_of_a_module_in_the_checkout():
  """launch.py's _MODES, read from its source: each `module:function` is a function defined at
  the top of that module's file."""
  with open(os.path.join(ROOT, "launch.py"), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  modes = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
               and any(getattr(t, "id", None) == "_MODES" for t in n.targets))
  assert "rl" in modes and "serve" in modes
  for mode, target in modes.items():
    module, fn = target.split(":")
    path = os.path.join(ROOT, *module.split(".")) + ".py"
    with open(path, encoding="utf-8") as f:
      names = {n.name for n in ast.parse(f.read()).body if isinstance(n, ast.FunctionDef)}
    assert fn in names, f"--mode={mode}: {target} is not a function of {path}"


def test_launch_writes_compiled_programs_to_the_persistent_cache(tmp_path):
  cache = tmp_path / "jax_cache"
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), "--mode=model",
                        "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"),
                        f"--config.workdir={tmp_path}", f"--config.jax_cache_dir={cache}",
                        "--config.jax_cache_min_compile_s=0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "scored a batch" in out.stdout
  assert cache.is_dir() and any(cache.iterdir())


def test_plan_of_the_35b_config_follows_overrides_of_depth_and_context():
  """--config.model.num_hidden_layers=4 plans a tenth of the layers' parameters (the preset is
  a default), --config.train.max_context=4096 plans the engine at 4096 tokens (rollout.max_len
  follows it), and the resolved model and config are printed first."""
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), "--mode=plan",
                        "--config=" + os.path.join(ROOT, "configs/qwen3_5_35b_a3b.py"),
                        "--config.model.num_hidden_layers=4", "--config.train.max_context=4096"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert lines[0].startswith("model: 4 layers (3 Gated DeltaNet, 1 attention), hidden 2048")
  assert lines[0].endswith("preset qwen3_5_35b_a3b, set over it: num_hidden_layers=4")
  assert lines[1].startswith("config qwen3_5_35b_a3b: ")
  assert "  rollout.turn_cache = 256  (base: 0)" in lines
  # 40 layers of 35B-A3B hold 33.64 B parameters, the embedding and the LM head 1.02 B.
  full = qwen3_5.config_from_dict(qwen3_5_35b_a3b.get_config().model)
  outside = 2 * full.vocab_size * full.hidden_size
  expected = outside + (qwen3_5.count_params(full)["total"] - outside) / 10
  planned = float(re.search(r"parameters: total ([\d.]+) B", out.stdout).group(1)) * 1e9
  assert planned == pytest.approx(expected, abs=0.006e9)
  assert re.search(r"Rollout engine: .* max_len 4096 \(train.max_context 4096\)", out.stdout)
