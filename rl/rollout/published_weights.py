"""Weight sync between separate jobs: the trainer publishes each version of the policy under a
directory, rollout servers watch it and swap each new version in.

    # each rollout job (its own hosts / slice):
    python launch.py --mode=serve --config=... --port=9000 --config.rollout.weights_dir=DIR
    # the trainer:
    python launch.py --mode=rl --config=... --config.rollout.servers=host1:9000,host2:9000 \
        --config.rollout.weights_dir=DIR

Trainer side, `WeightPublisher.update_weights(params, version)`: saves the params as orbax step
`version` under DIR (orbax writes into a temporary directory and renames it when complete, so
a reader never sees half a version), then asks every server which version it serves, with a
one-token request whose response carries `weights_version`, until all report `version`. Only
then does the loop roll out, so every rollout of a step comes from that step's weights (the
synchronous loop's guarantee, as with the in-process server).

Server side, `WeightWatcher`: a thread that polls DIR and, when its newest version is not the
one served, restores it straight onto the engine's devices (the engine's shardings are the
restore target, so each device reads its own shards) and swaps it in with
`engine.update_params` (a swap between two decode steps; never a recompile). A server started
this way serves version -1 (its random init) until the first version arrives.

The newest version always wins, also when it is older than the one served: a trainer resumed
from checkpoint k removes the versions above k that the crashed run had published, and the
servers go back to k. One DIR per run: a run starting afresh refuses a DIR holding versions.
"""
import logging
import os
import shutil
import threading
import time
from typing import Optional, Sequence

import jax

from envs.harness.jetstream_client import EngineError
from envs.harness.jetstream_client import TokenClient
from models.sharding import shape_dtype_mismatches
from rl.checkpoint import Checkpointer

log = logging.getLogger(__name__)

UNLOADED = -1   # the version a watching server reports before any published one is loaded


class WeightSyncTimeout(RuntimeError):
  """Some rollout server did not report the published version in time."""


def _checkpointer(weights_dir: str, keep: int) -> Checkpointer:
  return Checkpointer(weights_dir, save_every=1, keep=keep, async_save=False)


class WeightPublisher:
  """The trainer's end: publish a version, then wait until every server serves it.

  Args:
    weights_dir: the directory the servers watch (shared storage on a cluster).
    addresses: "host:port" of every rollout server.
    timeout_s: how long to wait for all servers to report a version.
    keep: versions kept under weights_dir (older ones are deleted after a publish).
    poll_s: interval between version probes.
    probe_token: the one-token prompt of a probe.
  """

  def __init__(self, weights_dir: str, addresses: Sequence[str], timeout_s: float = 600.0,
               keep: int = 2, poll_s: float = 0.5, probe_token: int = 0):
    if not weights_dir:
      raise ValueError("rollout.servers is set but rollout.weights_dir is empty: name the "
                       "directory the servers watch (--config.rollout.weights_dir)")
    if not addresses:
      raise ValueError("WeightPublisher needs at least one server address")
    self.weights_dir = os.path.abspath(weights_dir)
    self.addresses = tuple(addresses)
    self.timeout_s = float(timeout_s)
    self.poll_s = float(poll_s)
    self.probe_token = int(probe_token)
    self._ckpt = _checkpointer(self.weights_dir, keep)
    self._clients = [TokenClient(a, timeout_s=max(self.timeout_s, 1.0)) for a in self.addresses]

  def require_empty(self) -> None:
    """A run that starts afresh needs a directory without versions: a server still serving an
    earlier run's version 0 would answer the probe for this run's version 0."""
    steps = self._ckpt.all_steps()
    if steps:
      raise ValueError(
          f"rollout.weights_dir={self.weights_dir} holds weights versions {steps} of an earlier "
          f"run; a run starting afresh needs a directory of its own (or remove those)")

  def update_weights(self, params, version: Optional[int] = None) -> int:
    """Publishes `params` as `version` and returns once every server serves it."""
    if version is None or int(version) < 0:
      raise ValueError(f"a published version must be a step number >= 0, got {version!r}")
    version = int(version)
    steps = self._ckpt.all_steps()
    for stale in (s for s in steps if s > version):
      # Published by a run that crashed after this step's checkpoint; the servers must not keep
      # serving it (the newest version wins).
      log.warning("removing weights version %d from %s (newer than the resumed step %d)",
                  stale, self.weights_dir, version)
      if jax.process_index() == 0:
        shutil.rmtree(os.path.join(self.weights_dir, str(stale)), ignore_errors=True)
    if version in steps:
      # The same step's weights (a resumed run publishes its checkpoint's step again).
      log.info("weights version %d already published in %s", version, self.weights_dir)
    else:
      self._ckpt.save(version, {"params": params}, {"version": version})
      self._ckpt.wait()
    self.wait_for(version)
    return version

  def served_versions(self) -> dict:
    """address -> the version its response reports, or the error of the probe."""
    out = {}
    for addr, client in zip(self.addresses, self._clients):
      try:
        g = client.generate([self.probe_token], None, max_tokens=1, stop_ids=(),
                            timeout_s=max(5.0, self.poll_s))
        out[addr] = int(g.weights_version)
      except EngineError as e:
        out[addr] = e
    return out

  def wait_for(self, version: int) -> None:
    deadline = time.monotonic() + self.timeout_s
    while True:
      seen = self.served_versions()
      behind = {a: v for a, v in seen.items() if v != version}
      if not behind:
        return
      if time.monotonic() > deadline:
        what = "; ".join(f"{a} serves version {v}" if isinstance(v, int) else f"{a}: {v}"
                         for a, v in behind.items())
        raise WeightSyncTimeout(
            f"after {self.timeout_s:.0f} s not every rollout server serves weights version "
            f"{version} published in {self.weights_dir} ({what}). Are they running "
            f"`launch.py --mode=serve` with --config.rollout.weights_dir={self.weights_dir} and "
            f"the same model config? (a server's log says why it could not load a version)")
      time.sleep(self.poll_s)

  def stop(self) -> None:
    """Closes the connections; the servers (separate jobs) keep running."""
    for c in self._clients:
      c.close()
    self._ckpt.close()


def _check_matches(saved, target) -> None:
  """Raises ValueError naming the params whose saved shape / dtype differ from the engine's
  (a trainer with another model config), before any restore starts. Float dtypes may differ:
  the restore casts float32 master weights to the engine's rollout.weights_dtype."""
  bad = shape_dtype_mismatches(saved, target, cast_floats=True)
  if bad:
    raise ValueError(f"{len(bad)} published params differ from this engine's (published != "
                     f"served): " + "; ".join(bad[:4]))


class WeightWatcher:
  """The server's end: a daemon thread that swaps each newly published version into `engine`.

  Args:
    weights_dir: the directory the trainer publishes to.
    engine: the QwenEngine being served.
    poll_s: interval between looks at the directory.
  """

  def __init__(self, weights_dir: str, engine, poll_s: float = 0.5):
    self.weights_dir = os.path.abspath(weights_dir)
    self.engine = engine
    self.poll_s = float(poll_s)
    self.loaded: Optional[int] = None
    self.failed: dict[int, str] = {}   # version -> why it could not be loaded
    self._ckpt = _checkpointer(self.weights_dir, keep=0)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="weight-watcher", daemon=True)

  def start(self) -> "WeightWatcher":
    self._thread.start()
    return self

  def poll_once(self) -> Optional[int]:
    """Loads the newest published version if it is not the one served; returns the version
    served afterwards (None before any load)."""
    steps = self._ckpt.all_steps()
    if not steps or steps[-1] == self.loaded or steps[-1] in self.failed:
      return self.loaded
    version = steps[-1]
    t0 = time.monotonic()
    try:
      target = self.engine.sync_target()   # the params, or with LoRA the adapters
      _check_matches(self._ckpt.saved_state_metadata(version)["params"], target)
      state, _ = self._ckpt.restore(version, {"params": target})
      self.engine.update_params(state["params"], version=version)
    except Exception as e:  # pylint: disable=broad-except
      # Keep serving the current weights; the trainer's wait names this server and times out.
      msg = f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"
      self.failed[version] = msg
      log.error("weights version %d in %s not loaded, still serving version %s: %s",
                version, self.weights_dir, self.loaded, msg)
      return self.loaded
    self.loaded = version
    log.warning("serving weights version %d from %s (loaded in %.2f s)", version,
                self.weights_dir, time.monotonic() - t0)
    return version

  def _run(self):
    while not self._stop.is_set():
      try:
        self.poll_once()
      except Exception as e:  # pylint: disable=broad-except
        # A directory being written or pruned under us; look again at the next poll.
        log.warning("watching %s: %s: %s", self.weights_dir, type(e).__name__, e)
      self._stop.wait(self.poll_s)

  def stop(self) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()
    self._ckpt.close()
