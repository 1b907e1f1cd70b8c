"""JetStream runs without seqio and TensorFlow: the stand-in satisfies its import, refuses use,
and gives way to a real seqio where one is installed."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_IMPORT_JETSTREAM = """
import sys
sys.path.insert(0, sys.argv[1])


class Absent:  # as if seqio and TensorFlow were not installed (the Makefile installs neither)
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("seqio", "tensorflow", "tensorflow_text", "tensorflow_datasets"):
      raise ModuleNotFoundError(name)
    return None


sys.meta_path.insert(0, Absent())
import rl.rollout.orchestrator          # the server: JetStream's orchestrator and token_utils
import rl.rollout.engine
from seqio.vocabularies import Vocabulary
try:
  Vocabulary()
except RuntimeError as e:
  assert "seqio is not installed" in str(e)
else:
  raise AssertionError("the stand-in vocabulary constructed")
assert "tensorflow" not in sys.modules
print("ok")
"""

_REAL_SEQIO_STAYS = """
import sys
sys.path.insert(0, sys.argv[1])
from rl.rollout import seqio_standin
assert seqio_standin.install_if_missing() is False
import seqio
assert seqio.REAL is True
print("ok")
"""


def _run(code, *args, env=None):
  out = subprocess.run([sys.executable, "-c", code, ROOT, *args], capture_output=True, text=True,
                       timeout=300, env=env)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_jetstream_serving_modules_import_without_seqio_or_tensorflow():
  _run(_IMPORT_JETSTREAM)


def test_an_installed_seqio_is_left_alone(tmp_path):
  pkg = tmp_path / "seqio"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("REAL = True\n")
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  _run(_REAL_SEQIO_STAYS, env=env)
