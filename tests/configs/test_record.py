"""The resolved config as a run's record: differences from configs/base.py, the model's line."""
import os
import subprocess
import sys

from configs import base
from configs import qwen3_5_35b_a3b
from configs import record
from configs import tiny_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_differences_from_base_name_each_key_with_both_resolved_values():
  diff = record.differences(tiny_cpu.get_config())
  assert ("train.max_context", 2560, 4096) in diff
  assert ("train.seq_len", 2560, 4096) in diff        # derived: its resolved value
  assert ("rollout.max_len", 2560, 4096) in diff
  assert all(a != b for _, a, b in diff)
  assert record.differences(base.get_config()) == []


def test_the_model_line_names_the_preset_and_the_fields_set_over_it():
  c = qwen3_5_35b_a3b.get_config()
  assert record.model_line(c).endswith("; preset qwen3_5_35b_a3b")
  c.model.num_experts = 128
  c.model.hidden_size = 1024
  line = record.model_line(c)
  assert "hidden 1024" in line and "MoE 128 experts (top 8)" in line
  assert line.endswith("; preset qwen3_5_35b_a3b, set over it: hidden_size=1024, num_experts=128")
  assert record.model_line(tiny_cpu.get_config()).endswith("; no preset")


def test_the_record_starts_no_backend():
  """launch.py prints the record before a mode runs; a mode that sets devices up itself (the
  compile-only devices of --mode=compile) still finds no backend started."""
  code = ("from jax._src import xla_bridge\n"
          "from configs import qwen3_5_397b_a17b, record\n"
          "assert record.report(qwen3_5_397b_a17b.get_config()).startswith('model: 60 layers')\n"
          "print('backends started:', xla_bridge.backends_are_initialized())\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "backends started: False" in out.stdout
