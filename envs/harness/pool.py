"""One agent loop per process: a pool of workers that each run one episode at a time.

Why processes: a tool that wedges a C extension, leaks memory or segfaults takes down its
own process, not the batch. Each worker runs in its own process group, so that killing it
also kills the world (MCP gateway) processes it started.

The parent enforces the outer deadline: a worker still busy `kill_grace_s` after its
episode's own timeout is killed (outcome `episode_timeout`); a worker that dies is recorded
(outcome `harness_bug`, with its exit code) and replaced; either way the batch goes on and
every other trajectory is kept. A worker whose episode abandoned a hung call (`tainted`) is
recycled after returning its result.

Judge criteria (envs/judge.py) do not hold a worker: its episode's judge requests go to the
process's judge threads, the worker reports the episode as `judging` (with its provisional
result) and starts its next one, and sends the verdicts when they arrive; the parent completes
the result then (`agent_loop.apply_verdicts`). `run` still returns every result in episode
order. Verdicts not back within `episode_timeout_s + kill_grace_s`, or lost with their worker,
make the pending criteria judge errors. Episodes without judge criteria are graded
synchronously, as before.
"""
import dataclasses
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from multiprocessing import connection
from typing import Any, Callable, Sequence

from envs.chat.format import ChatFormat
from envs.chat.tokenizer import load_tokenizer
from envs.harness import errors
from envs.harness.agent_loop import LoopSettings
from envs.harness.agent_loop import apply_verdicts
from envs.harness.agent_loop import run_episode
from envs.harness.agent_loop import unjudged
from envs.harness.world import Episode
from envs.harness.world import EpisodeResult
from envs.harness.world import run_exit_hooks


@dataclasses.dataclass(frozen=True)
class FormatSpec:
  """How a worker builds its tokenizer and chat format (picklable)."""
  tokenizer_path: str = ""
  special_ids: str = "tiny"
  thinking: bool = True

  @classmethod
  def from_config(cls, c) -> "FormatSpec":
    return cls(c.tokenizer.path, c.tokenizer.special_ids, c.tokenizer.thinking)

  def build(self):
    return ChatFormat(load_tokenizer(self.tokenizer_path, self.special_ids), self.thinking)


class PoolInitError(RuntimeError):
  """A worker could not build its tokenizer or policy: a configuration error, not a rollout's."""


def _worker_main(conn, fmt_spec: FormatSpec, policy_factory, settings: LoopSettings,
                 start_gate=None):
  # Own process group: the parent's killpg takes the world processes down with us.
  os.setpgrp()
  try:
    fmt = fmt_spec.build()
    policy = policy_factory(fmt)
  except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
    conn.send(("init_error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    return
  conn.send(("ready", os.getpid()))
  lock = threading.Lock()  # judge threads send verdicts while the loop sends results

  def send(msg):
    with lock:
      conn.send(msg)
  seq = 0
  try:
    while True:
      try:
        episode = conn.recv()
      except (EOFError, OSError):
        return
      if episode is None:
        return
      seq += 1
      sink: list = []
      res = run_episode(episode, policy, fmt, settings, start_gate, judge_sink=sink)
      if not sink:
        send(("result", res))
        continue
      send(("judging", seq, res))
      sink[-1].when_done(lambda p, n=seq: _send_verdicts(send, n, p))
  finally:
    run_exit_hooks()


def _send_verdicts(send, seq: int, pending) -> None:
  """Sends ("judged", seq, update or None, why, seconds) for an episode's pending verdicts."""
  try:
    update, why = pending.result(), ""
  except Exception as e:  # noqa: BLE001 - the parent turns it into judge errors
    update, why = None, f"grading with the judge failed: {type(e).__name__}: {e}"
  try:
    send(("judged", seq, update, why, time.monotonic() - pending.t0))
  except (OSError, ValueError):
    pass  # the parent is gone or closed the pipe; nobody waits for these verdicts


@dataclasses.dataclass
class _Worker:
  proc: Any
  conn: Any
  job: tuple[int, Episode, float] | None = None  # (index, episode, kill deadline)
  world: Any = None                               # world key of its last episode
  # Episodes awaiting judge verdicts: seq -> (index, provisional result, verdict deadline).
  judging: dict = dataclasses.field(default_factory=dict)
  retire: bool = False                            # replace once its verdicts are in


def _world_key(ep: Episode):
  return ep.meta.get("world_id")


def _take(pending: list, key, held: frozenset = frozenset()) -> tuple[int, Episode]:
  """Next episode for a worker whose warm world is `key`: the first one in that world (a
  world start costs seconds: a sandboxed gateway process, its imports, the MCP handshake),
  else the first whose world no other busy worker holds (that worker will take it warm), else
  the first in line. So the G samples of a group mostly run on one warm world instead of
  starting G gateways."""
  if key is not None:
    for j, (_, ep) in enumerate(pending):
      if _world_key(ep) == key:
        return pending.pop(j)
  for j, (_, ep) in enumerate(pending):
    if _world_key(ep) not in held:
      return pending.pop(j)
  return pending.pop(0)


def world_start_slots(setting: int) -> int:
  """Worlds that may start at once: `setting` if >= 0 (0 = no limit), else two per usable CPU
  core. A start is ~0.25 s of CPU, so the gate caps rollouts at about slots / 0.25 s episodes a
  second: a fixed 4 suits a 2-core host (more only pushes starts past their timeout) but held a
  16-core GPU host to ~16 episodes a second, its episodes waiting 1.1-2.0 s for a slot against
  0.2-0.3 s of model time."""
  if setting >= 0:
    return int(setting)
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    cores = os.cpu_count() or 1
  return 2 * cores


class AgentPool:
  """A fixed number of agent-loop processes.

  Args:
    num_workers: processes (= concurrent episodes).
    fmt_spec: tokenizer and chat format of the workers.
    policy_factory: picklable callable `ChatFormat -> Policy`, called once in each worker.
    settings: the loop settings.
    kill_grace_s: how long past an episode's timeout the parent waits before killing.
    start_method: multiprocessing start method. "forkserver" (default) forks each agent
      process from a clean server that has already imported `preload`, so a new process
      costs milliseconds and shares those pages; "spawn" imports everything in every
      process. Both are safe with threads in the parent (JAX, gRPC), where "fork" is not.
    max_world_starts: worlds starting at once across the pool; 0 = no limit; < 0 = two per
      CPU core this process may use (`world_start_slots`).
    preload: modules the fork server imports once (forkserver only; effective when the fork
      server first starts in this process).
  """

  def __init__(self, num_workers: int, fmt_spec: FormatSpec, policy_factory: Callable,
               settings: LoopSettings, kill_grace_s: float = 10.0,
               start_method: str = "forkserver", max_world_starts: int = 0,
               preload: Sequence[str] = ()):
    if num_workers < 1:
      raise ValueError("num_workers must be >= 1")
    self._ctx = mp.get_context(start_method)
    if start_method == "forkserver":
      self._ctx.set_forkserver_preload(["envs.harness.pool", *preload])
    max_world_starts = world_start_slots(max_world_starts)
    gate = self._ctx.BoundedSemaphore(max_world_starts) if max_world_starts > 0 else None
    self._args = (fmt_spec, policy_factory, settings, gate)
    self._settings = settings
    self._grace = kill_grace_s
    self.deaths: list[dict[str, Any]] = []   # every worker lost: pid, exit code, why
    self.recycled = 0
    self._workers = [self._spawn() for _ in range(num_workers)]
    for w in self._workers:
      self._await_ready(w)

  @classmethod
  def from_config(cls, c, policy_factory: Callable, num_workers: int | None = None
                  ) -> "AgentPool":
    """A pool with every knob from the config (`harness`, `tokenizer`, `train`, `rl`)."""
    return cls(num_workers or c.harness.num_workers, FormatSpec.from_config(c), policy_factory,
               LoopSettings.from_config(c), c.harness.kill_grace_s,
               start_method=c.harness.start_method,
               max_world_starts=c.harness.max_world_starts, preload=tuple(c.harness.preload))

  def _spawn(self) -> _Worker:
    parent, child = self._ctx.Pipe()
    proc = self._ctx.Process(target=_worker_main, args=(child,) + self._args, daemon=True)
    proc.start()
    child.close()
    return _Worker(proc, parent)

  def _await_ready(self, w: _Worker, timeout: float = 120.0) -> None:
    if not w.conn.poll(timeout):
      self._kill(w)
      raise PoolInitError(f"agent process {w.proc.pid} did not start within {timeout}s")
    try:
      kind, payload = w.conn.recv()
    except (EOFError, OSError) as e:
      raise PoolInitError(f"agent process {w.proc.pid} died while starting "
                          f"(exit code {w.proc.exitcode})") from e
    if kind != "ready":
      self._kill(w)
      raise PoolInitError(f"agent process failed to start: {payload}")

  @staticmethod
  def _kill(w: _Worker) -> None:
    try:
      os.killpg(w.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    try:
      w.proc.kill()
    except Exception:  # noqa: BLE001 - already gone
      pass
    w.proc.join(5)
    w.conn.close()

  def _replace(self, i: int) -> None:
    self._kill(self._workers[i])
    self._workers[i] = self._spawn()
    self._await_ready(self._workers[i])

  @property
  def size(self) -> int:
    return len(self._workers)

  @property
  def pids(self) -> list[int]:
    return [w.proc.pid for w in self._workers]

  def run(self, episodes: Sequence[Episode],
          on_result: Callable[[EpisodeResult], None] | None = None) -> list[EpisodeResult]:
    """Runs every episode; returns one result per episode, in order, whatever happens.
    `on_result` (e.g. a progress bar) is called with each result as it arrives."""
    results: list[EpisodeResult | None] = [None] * len(episodes)
    pending = list(enumerate(episodes))
    budget = self._settings.episode_timeout_s + self._grace

    def done(idx, res):
      results[idx] = res
      if on_result is not None:
        on_result(res)

    while pending or any(w.job or w.judging for w in self._workers):
      self._dispatch(pending, budget)
      ready = self._wait()
      now = time.monotonic()
      for i, w in enumerate(self._workers):
        if w.job is None and not w.judging:
          continue
        self._tend(i, w, ready, now, budget, done)
    return results  # type: ignore[return-value]

  def _dispatch(self, pending: list, budget: float) -> None:
    """Sends the next episode to each idle worker, preferring the world it ran last."""
    for w in self._workers:
      if w.job is None and pending and not w.retire:
        held = frozenset(o.world for o in self._workers if o.job is not None)
        idx, ep = _take(pending, w.world, held)
        w.world = _world_key(ep)
        w.job = (idx, ep, time.monotonic() + budget)
        w.conn.send(ep)

  def _wait(self) -> list:
    """Waits for a message or a death of a busy worker, or until the nearest deadline."""
    busy = [w for w in self._workers if w.job or w.judging]
    deadlines = [w.job[2] for w in busy if w.job] + [
        d for w in busy for _, _, d in w.judging.values()]
    wait_s = max(0.0, min(deadlines) - time.monotonic())
    return connection.wait([w.conn for w in busy] + [w.proc.sentinel for w in busy],
                           timeout=wait_s)

  def _tend(self, i: int, w, ready: list, now: float, budget: float, done) -> None:
    """One busy worker after a wait: its messages, its death, its deadlines, its retirement."""
    if w.conn in ready and self._receive(w, now, budget, done):
      # Its episode ended: a death now is the next episode's (as it finds it).
      if w.retire and not w.judging:
        self.recycled += 1
        self._replace(i)
      return
    if w.proc.sentinel in ready or (w.conn in ready and not w.proc.is_alive()):
      w.proc.join(1)
      code = w.proc.exitcode
      task_id = w.job[1].task_id if w.job else ""
      self.deaths.append(dict(pid=w.proc.pid, exitcode=code, task_id=task_id, why="died"))
      if w.job is not None:
        done(w.job[0], _failed(w.job[1], errors.HARNESS_BUG,
                               f"agent process {w.proc.pid} died (exit code {code})"))
        w.job = None
      _unjudge(w, f"agent process {w.proc.pid} died before the verdicts came", done)
      self._replace(i)
      return
    if w.job is not None and now >= w.job[2]:
      idx, ep, _ = w.job
      self.deaths.append(dict(pid=w.proc.pid, exitcode=None, task_id=ep.task_id,
                              why="killed at the episode deadline"))
      done(idx, _failed(ep, errors.EPISODE_TIMEOUT,
                        f"agent process {w.proc.pid} still busy {self._grace}s after "
                        f"the episode timeout; killed"))
      w.job = None
      _unjudge(w, f"agent process {w.proc.pid} killed before the verdicts came", done)
      self._replace(i)
      return
    for seq in [q for q, (_, _, d) in w.judging.items() if now >= d]:
      idx, res, _ = w.judging.pop(seq)
      done(idx, unjudged(res, f"no verdict within {budget:.0f}s of the episode's end"))
    if w.retire and w.job is None and not w.judging:
      self.recycled += 1
      self._replace(i)

  @staticmethod
  def _receive(w, now: float, budget: float, done) -> bool:
    """Reads every message the worker has sent; True when its episode ended (a result, or a
    result waiting for its judge verdicts)."""
    msgs = []
    try:
      while True:
        msgs.append(w.conn.recv())
        if not w.conn.poll():
          break
    except (EOFError, OSError):
      pass  # gone: found dead by the caller
    freed = False
    for msg in msgs:
      if msg[0] == "result" and w.job is not None:
        done(w.job[0], msg[1])
        w.job, freed = None, True
        w.retire = w.retire or msg[1].tainted
      elif msg[0] == "judging" and w.job is not None:
        w.judging[msg[1]] = (w.job[0], msg[2], now + budget)
        w.job, freed = None, True
        w.retire = w.retire or msg[2].tainted
      elif msg[0] == "judged" and msg[1] in w.judging:
        idx, res, _ = w.judging.pop(msg[1])
        _, _, update, why, secs = msg
        res = apply_verdicts(res, update) if update is not None else unjudged(res, why)
        res.timing["judge"] = float(secs)
        done(idx, res)
    return freed

  def close(self) -> None:
    for w in self._workers:
      try:
        w.conn.send(None)
      except (OSError, BrokenPipeError):
        pass
    for w in self._workers:
      w.proc.join(2)
      if w.proc.is_alive():
        self._kill(w)
    self._workers = []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _unjudge(w, why: str, done) -> None:
  """Every result of worker `w` still waiting for verdicts, completed without them."""
  for idx, res, _ in w.judging.values():
    done(idx, unjudged(res, why))
  w.judging = {}


def _failed(ep: Episode, outcome: str, detail: str) -> EpisodeResult:
  return EpisodeResult(task_id=ep.task_id, group_id=ep.group_id, sample_index=ep.sample_index,
                       outcome=outcome, detail=detail, meta=dict(ep.meta))
