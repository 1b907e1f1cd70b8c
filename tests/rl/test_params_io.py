"""Start weights and saved params: HF init, orbax saves across topologies, the start fingerprint."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import tiny_cpu
from models import qwen3_5
from rl import params_io
from rl.train_step import TrainStep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_init_from_loads_a_hugging_face_checkpoint_and_rejects_other_shapes(tmp_path):
  c = tiny_cpu.get_config()
  cfg = qwen3_5.config_from_dict(c.model)
  params = qwen3_5.init_params(cfg, jax.random.key(3))
  qwen3_5.save_hf(cfg, params, str(tmp_path / "ck"))
  with c.unlocked():
    c.train.init_from = str(tmp_path / "ck")
  got = params_io.init_params(c)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Read straight into the train step's shards: same values, the step's layout.
  from models import sharding as shd
  shardings = TrainStep(c, shd.make_mesh(c.mesh)).state_shardings["params"]
  got = params_io.init_params(c, shardings)
  for a, b, sh in zip(jax.tree.leaves(got), jax.tree.leaves(params), jax.tree.leaves(shardings)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding.is_equivalent_to(sh, a.ndim)
  with c.unlocked():
    c.model.hidden_size = 32
  with pytest.raises(ValueError, match="another shape"):
    params_io.init_params(c)
  with pytest.raises(ValueError, match="another shape"):
    params_io.init_params(c, shardings)
  with c.unlocked():
    c.train.init_from = str(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match="init_from"):
    params_io.init_params(c)


def test_save_params_keeps_the_newest_save_and_load_params_returns_it(tmp_path):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
  first = params_io.init_params(c)
  second = jax.tree.map(lambda x: x + 1.0, first)
  d = str(tmp_path / "sft")
  assert params_io.load_params(d, c) is None
  params_io.save_params(d, first, {"steps": 50}, 50)
  params_io.save_params(d, second, {"steps": 100}, 100)
  got = params_io.load_params(d, c)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(second)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_start_fingerprint_follows_the_starting_weights(tmp_path):
  c = tiny_cpu.get_config()
  base = tmp_path / "base"
  base.mkdir()
  (base / "config.json").write_text("{}")
  blob = bytearray(3 << 20)                       # > 2 MiB: head and tail are read
  (base / "model.safetensors").write_bytes(bytes(blob))
  with c.unlocked():
    c.train.init_from = str(base)
  first = params_io.start_fingerprint(c)
  assert params_io.start_fingerprint(c) == first
  blob[-1] = 1                                    # a change in the last MiB
  (base / "model.safetensors").write_bytes(bytes(blob))
  assert params_io.start_fingerprint(c) != first
  c.train.init_from = ""
  assert params_io.start_fingerprint(c) == f"random-init-seed-{c.seed}"
  c.train.init_from = str(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match="is not a directory"):
    params_io.start_fingerprint(c)


_SAVE_ON_16_DEVICES = """
import sys
sys.path.insert(0, sys.argv[1])
import jax
from configs import tiny_cpu
from rl import params_io
c = tiny_cpu.get_config()
with c.unlocked():
  c.train.init_from = ""
params = jax.tree.map(lambda x: x + 1.0, params_io.init_params(c))
mesh = jax.sharding.Mesh(jax.devices(), ("d",))
on_all = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
params_io.save_params(sys.argv[2], jax.device_put(params, on_all), {"steps": 4}, 4)
"""


def test_load_params_restores_params_saved_on_another_topology(tmp_path, test_compile_flags):
  # A CPU run's SFT params read by a GPU run (or another mesh): orbax refuses a target without
  # shardings when the saved topology differs, which once sent such a run back to SFT.
  d = str(tmp_path / "sft")
  # Saved on more devices than this process has (orbax accepts a shardless target only when
  # the saved topology fits the present one).
  # Compiled as this process compiles (tests/conftest.py): the params are drawn there and here,
  # and compared bit for bit (at another level the normal draw differs by an ulp).
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count=16 {test_compile_flags}")
  subprocess.run([sys.executable, "-c", _SAVE_ON_16_DEVICES, ROOT, d], env=env, check=True,
                 capture_output=True, timeout=300)
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
  got = params_io.load_params(d, c)
  want = jax.tree.map(lambda x: x + 1.0, params_io.init_params(c))
  assert jax.device_count() < 16 and got is not None
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_params_of_a_directory_not_written_yet_is_none_with_or_without_meta(tmp_path):
  c = tiny_cpu.get_config()
  missing = str(tmp_path / "sft")
  assert params_io.load_params(missing, c) is None
  assert params_io.load_params_and_meta(missing, c) == (None, None)


def test_load_params_names_saved_params_that_do_not_restore(tmp_path):
  c = tiny_cpu.get_config()
  with c.unlocked():
    c.train.init_from = ""
  d = str(tmp_path / "sft")
  params_io.save_params(d, params_io.init_params(c), {"steps": 4}, 4)
  for root, _, files in os.walk(os.path.join(d, "4", "state")):
    for f in files:
      os.remove(os.path.join(root, f))
  with pytest.raises(ValueError, match=r"holds saved params \(step 4\) that do not restore"):
    params_io.load_params(d, c)
  assert os.path.isdir(os.path.join(d, "4"))   # nothing saved is removed
