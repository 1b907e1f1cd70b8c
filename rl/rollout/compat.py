"""Compatibility of google-jetstream 0.2.2 (2024) with the JAX this project pins.

Everything the project needs to patch in JetStream is here, applied once on import:

1. `jax.tree_map` was removed in JAX 0.6; JetStream's orchestrator calls it in
   `delete_pytree` after every insert, which kills the generate thread on the first request.
   It is aliased to `jax.tree.map` (same semantics).
2. Importing `jetstream.core.orchestrator` sets the root logger to DEBUG and adds a stdout
   handler, so every decode step would be logged by every thread. The root logger's level
   and handlers are restored right after the import; `set_log_level` chooses the level.
"""
import logging

import jax

if not hasattr(jax, "tree_map"):
  jax.tree_map = jax.tree.map

_root = logging.getLogger()
_level, _handlers = _root.level, list(_root.handlers)
from jetstream.core import orchestrator as _orchestrator  # noqa: E402,F401  pylint: disable=g-import-not-at-top
for _h in list(_root.handlers):
  if _h not in _handlers:
    _root.removeHandler(_h)
_root.setLevel(_level)


def set_log_level(level: str) -> None:
  """Sets the level of the root logger JetStream's threads log to (e.g. "WARNING")."""
  logging.getLogger().setLevel(getattr(logging, level.upper()))
