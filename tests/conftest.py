"""Shared pytest setup.

Eight fake CPU devices are created before jax is imported anywhere, so sharding tests can
build real meshes; single-device code simply runs on device 0.
"""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402


def pytest_addoption(parser):
  parser.addoption("--run-slow", action="store_true", default=False,
                   help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
  if config.getoption("--run-slow"):
    return
  skip_slow = pytest.mark.skip(reason="slow: run with --run-slow (make test-all)")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip_slow)
