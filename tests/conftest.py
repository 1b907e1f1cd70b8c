"""Shared pytest setup.

Eight fake CPU devices are created before jax is imported anywhere, so sharding tests can
build real meshes; single-device code simply runs on device 0.
"""
import functools
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

# This process compiles at LLVM -O0 and with XLA:CPU's older fusion emitters: the tests here
# build many small programs and run each a few times, so compiling is most of their time (-O0
# took a test file of train steps from 285 s to 223 s; the older emitters then took
# tests/models/test_qwen3_5.py's compiles from 229 to 156 s, the file from 300 to 221 s, on a
# 2-core machine). The numerics are checked against the same tolerances; the few bit-for-bit
# comparisons of two differently written programs compile with the default emitters
# (the `default_emitters_jit` fixture below), under which the claim is made.
# The programs the tests launch as processes (launch.py, the servers, the benchmarks) inherit
# the flags without these and compile as users' runs do: XLA reads XLA_FLAGS once per process,
# at its first compile, which happens here. The long launches of the RL loop (the pod, the
# option arms, the kill-and-resume run, the separate rollout server) compile with these flags
# too (`launched_job_env`): what they check is the loop, not the compiler's output, and an
# option arm took 84 s instead of 104 s alone on 2 cores. `make run`'s own path,
# tests/test_e2e_rl.py's SFT-then-RL test, keeps users' flags.
TEST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
_flags = os.environ["XLA_FLAGS"]
_set_here = "xla_backend_optimization_level" not in _flags
if _set_here:
  os.environ["XLA_FLAGS"] = f"{_flags} {TEST_COMPILE_FLAGS}"

import jax  # noqa: E402  (after the flags: the first compile reads them)

if _set_here:
  jax.jit(lambda x: x + 1)(0).block_until_ready()
  os.environ["XLA_FLAGS"] = _flags


@pytest.fixture(scope="session")
def test_compile_flags() -> str:
  """TEST_COMPILE_FLAGS, for a subprocess whose results must equal this process's bit for bit."""
  return TEST_COMPILE_FLAGS


@pytest.fixture(scope="session")
def launched_job_env() -> dict:
  """The environment of a long launched RL job: one CPU device, TEST_COMPILE_FLAGS, unbuffered
  output (a pod's processes get their own device counts from scripts/local_pod.py)."""
  return dict(os.environ, PYTHONUNBUFFERED="1", XLA_FLAGS=TEST_COMPILE_FLAGS)


@pytest.fixture(scope="session")
def default_emitters_jit():
  """jax.jit compiling with XLA:CPU's default fusion emitters, as users' runs do: for two
  differently written programs compared bit for bit (under the older emitters of this process
  the LoRA-adapted and the plain forward round apart by ~1e-7)."""
  return functools.partial(jax.jit, compiler_options={"xla_cpu_use_fusion_emitters": True})


# Files that take the longest (clean-clone timings), sent first so that under `make test`'s two
# processes (pytest-xdist, one file per process at a time) no long file starts last.
LONGEST_FIRST = ("tests/test_e2e_pod.py", "tests/test_e2e_rl_options.py",
                 "tests/rl/test_train_step.py", "tests/test_e2e_rl.py",
                 "tests/models/test_qwen3_5.py", "tests/envs/test_harness_episodes.py",
                 "tests/envs/test_shell_harness.py", "tests/envs/test_worlds.py",
                 "tests/rl/test_compile_job.py")


def pytest_addoption(parser):
  parser.addoption("--run-slow", action="store_true", default=False,
                   help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
  rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(rank)))  # stable
  if config.getoption("--run-slow"):
    return
  skip_slow = pytest.mark.skip(reason="slow: run with --run-slow (make test-all)")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip_slow)
