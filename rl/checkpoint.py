"""Checkpoints of the train state with orbax: async saves, keep the last K, safe restore.

    ckpt = Checkpointer.from_config(config)
    ckpt.maybe_save(step, state, {"data_position": pos})      # every checkpoint.save_every
    restored = ckpt.restore_latest(train_step.abstract_state())
    if restored: step, state, meta = restored

A checkpoint holds the whole train state (params, optimizer state, step, RNG key data) and a
small JSON item (`meta`: data position and whatever else the loop needs to resume). Restore
targets the abstract state with its shardings, so every device reads only its own shards.

Orbax writes a step into a temporary directory and renames it when complete, so a save cut
short by a crash is never listed. A listed step that still fails to restore (files removed,
truncated, unreadable) is reported and the next older step is tried.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
  """Thin policy layer over `orbax.checkpoint.CheckpointManager`."""

  def __init__(self, directory: str, save_every: int, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    self.save_every = int(save_every)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=int(keep) if keep else None,
        save_interval_steps=max(self.save_every, 1),
        enable_async_checkpointing=bool(async_save),
        create=True)
    # Handlers named up front, so that a manager that has not saved can read a step's metadata
    # (shapes and dtypes) before restoring it.
    self.manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})
    self.skipped: list[tuple[int, str]] = []   # (step, error) of checkpoints that failed to load

  @classmethod
  def from_config(cls, config) -> "Checkpointer":
    c = config.checkpoint
    directory = c.dir or os.path.join(config.workdir, config.name, "checkpoints")
    return cls(directory, c.save_every, c.keep, c.async_save)

  # -- save --------------------------------------------------------------------------------

  def maybe_save(self, step: int, state: Any, meta: Optional[dict] = None) -> bool:
    """Saves when `step` is a multiple of save_every (0 = never). Returns whether it did."""
    if self.save_every <= 0 or step % self.save_every:
      return False
    return self.save(step, state, meta)

  def save(self, step: int, state: Any, meta: Optional[dict] = None, force: bool = True) -> bool:
    """Starts an (async) save of `state` at `step`; returns once the arrays are copied off."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              meta=ocp.args.JsonSave(dict(meta or {}, step=int(step))))
    return bool(self.manager.save(int(step), args=args, force=force))

  def wait(self):
    """Blocks until every pending async save is on disk."""
    self.manager.wait_until_finished()

  # -- restore -----------------------------------------------------------------------------

  def all_steps(self) -> list[int]:
    self.manager.reload()
    return sorted(self.manager.all_steps())

  def saved_state_metadata(self, step: int):
    """The saved state's tree of array metadata (shape, dtype) at `step`, read without
    restoring it."""
    return self.manager.item_metadata(int(step))["state"]

  def restore(self, step: int, abstract_state: Any):
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                              meta=ocp.args.JsonRestore())
    out = self.manager.restore(int(step), args=args)
    return out["state"], dict(out["meta"] or {})

  def restore_latest(self, abstract_state: Any):
    """(step, state, meta) of the newest checkpoint that restores, or None if there is none.

    A checkpoint that fails to restore is logged, remembered in `self.skipped`, and the
    previous one is tried.
    """
    self.wait()
    for step in reversed(self.all_steps()):
      try:
        state, meta = self.restore(step, abstract_state)
      except Exception as e:  # pylint: disable=broad-except
        msg = f"{type(e).__name__}: {e}"
        log.error("checkpoint step %d in %s is unreadable (%s); trying the previous one",
                  step, self.directory, msg.splitlines()[0][:300])
        self.skipped.append((step, msg))
        continue
      if jax.process_index() == 0:
        log.info("restored checkpoint step %d from %s", step, self.directory)
      return step, state, meta
    return None

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()
