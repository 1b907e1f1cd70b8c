"""launch.py as a user runs it."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
