"""The project's version, from one place: `version` in pyproject.toml.

Servers report it (the world gateway's MCP `serverInfo`, the rollout server's HTTP front).
"""
import os
import tomllib

_PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "pyproject.toml")


def _read() -> str:
  with open(_PYPROJECT, "rb") as f:
    return str(tomllib.load(f)["project"]["version"])


__version__ = _read()
