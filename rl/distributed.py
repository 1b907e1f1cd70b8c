"""One job over many processes: start-up, the same-run check, shares of work, exchanges.

Every host runs the same `launch.py` command. `initialize` joins the JAX job when the
environment names a coordinator (JAX_COORDINATOR_ADDRESS with JAX_NUM_PROCESSES and
JAX_PROCESS_ID, as scripts/local_pod.py and SLURM launchers set them, or a TPU pod's own
variables); the distributed runtime's heartbeat (distributed.heartbeat_timeout_s) stops every
process when one dies, so no collective waits forever. `check_same_run` then refuses to go on
unless every process runs the same config and the same code, naming what differs.

Work that is not a collective (rollouts, evals, oracle episodes) is split with `share`: process
i of n owns a contiguous, deterministic block of a list. `exchange` hands every process the
other processes' Python objects (episode results) through the coordinator's key-value store,
so each one can assemble the same global figures and batches the single-process run computes.
The store is used instead of a collective because exchanges may run in the rollout-prefetch
thread while the main thread runs the train step's collectives.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import pickle
import threading

import jax
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils
import numpy as np

# The variables a multi-process launch sets (any one of them asks for `jax.distributed`).
COORDINATOR_VARS = ("JAX_COORDINATOR_ADDRESS", "MEGASCALE_COORDINATOR_ADDRESS",
                    "TPU_WORKER_HOSTNAMES")
# The project's code, fingerprinted by `code_version` (relative to the repository root).
_CODE_DIRS = ("configs", "envs", "models", "rl")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One key-value entry stays under the coordinator's message size.
_CHUNK_BYTES = 2 << 20


def requested() -> bool:
  """Whether the environment names a coordinator to join.

  A job of one process joins one too when asked (`scripts/local_pod.py --processes 1`): its
  collectives then run through distributed.cpu_collectives as an N-process job's do, in the same
  order, so the two jobs' reductions agree to the bit (in-process collectives sum in another
  order, which differs in the last bits). Without the variables (`make run`) nothing is joined.
  """
  return any(k in os.environ for k in COORDINATOR_VARS)


def initialize(config) -> None:
  """Joins the multi-process JAX job the environment describes; nothing for one process.

  Must run before anything touches a JAX backend. On the CPU backend the processes' collectives
  go through distributed.cpu_collectives (gloo): fake CPU devices on one machine make a real
  multi-host job, collectives included.
  """
  if not requested() or jax_distributed.global_state.client is not None:
    return
  d = config.distributed
  jax.config.update("jax_cpu_collectives_implementation", str(d.cpu_collectives))
  env = os.environ
  # JAX reads the coordinator's address from the environment but not the process count and id;
  # where they are unset (a TPU pod, SLURM) its cluster detection finds them.
  jax.distributed.initialize(
      coordinator_address=env.get("JAX_COORDINATOR_ADDRESS"),
      num_processes=int(env["JAX_NUM_PROCESSES"]) if "JAX_NUM_PROCESSES" in env else None,
      process_id=int(env["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in env else None,
      initialization_timeout=int(d.init_timeout_s),
      heartbeat_timeout_seconds=int(d.heartbeat_timeout_s))


def is_writer() -> bool:
  """Process 0 alone writes metrics, summaries, tables and console progress."""
  return jax.process_index() == 0


def share(n: int, index: int | None = None, count: int | None = None) -> slice:
  """The block of `n` items process `index` of `count` owns (this process by default):
  contiguous, in order, sizes differing by at most one, the first blocks the larger."""
  index = jax.process_index() if index is None else int(index)
  count = jax.process_count() if count is None else int(count)
  base, extra = divmod(int(n), count)
  start = index * base + min(index, extra)
  return slice(start, start + base + (1 if index < extra else 0))


def _client():
  # The coordinator's key-value store has no public Python API in JAX 0.10; the client object
  # of `jax.distributed` exposes it (the same store JAX itself uses to exchange topology).
  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("rl.distributed.exchange needs jax.distributed to be initialized")
  return client


def exchange(tag: str, obj, timeout_s: float = 3600.0) -> list:
  """Every process's `obj` (picklable), in process order: the same list on every process.

  `tag` names this exchange and must be unique in the run and the same on every process (e.g.
  "eval/before/0"). One process: `[obj]`.
  """
  if jax.process_count() == 1:
    return [obj]
  client, me, ms = _client(), jax.process_index(), int(timeout_s * 1000)
  data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  chunks = [data[i:i + _CHUNK_BYTES] for i in range(0, len(data), _CHUNK_BYTES)] or [b""]
  key = f"qwen35rl/{tag}"
  for i, c in enumerate(chunks):
    client.key_value_set_bytes(f"{key}/{me}/{i}", c)
  client.key_value_set(f"{key}/{me}/n", str(len(chunks)))   # last: the chunks are all there
  out = []
  for p in range(jax.process_count()):
    n = int(client.blocking_key_value_get(f"{key}/{p}/n", ms))
    out.append(pickle.loads(b"".join(client.blocking_key_value_get_bytes(f"{key}/{p}/{i}", ms)
                                     for i in range(n))))
  # Every process has read every entry before any is removed.
  client.wait_at_barrier(f"{key}/read", ms)
  client.key_value_delete(f"{key}/{me}/")
  return out


_counters: dict = collections.defaultdict(itertools.count)
_counters_lock = threading.Lock()


def next_tag(kind: str) -> str:
  """A tag for the next exchange of `kind`. Every process makes the exchanges of one kind in the
  same order (one kind is made by one thread at a time: episodes by the rollout-prefetch thread
  or, between draws, by an eval; engine counters by the main thread), so the n-th tag of a kind
  is the same on each."""
  with _counters_lock:
    return f"{kind}/{next(_counters[kind])}"


def gather(tag: str, items: list, timeout_s: float = 3600.0) -> list:
  """The concatenation, in process order, of every process's `items`."""
  return [x for part in exchange(tag, list(items), timeout_s) for x in part]


def work_split(kind: str, timeout_s: float = 3600.0):
  """A splitter for code below `rl` that takes one as an argument (the evals of envs/):
  `split(items)` returns this process's block of the items and `collect(results)`, which returns
  every process's results, the blocks' in item order. One process: all items, results as they
  are."""
  def split(items):
    items = list(items)
    if jax.process_count() == 1:
      return items, list
    return items[share(len(items))], lambda results: gather(next_tag(kind), results, timeout_s)
  return split


def summed(tag: str, figures: dict, timeout_s: float = 3600.0) -> dict:
  """Every process's `figures` (name -> number) added up: counters of per-process parts (each
  host's rollout engine) as the job's totals. One process: `figures`."""
  if jax.process_count() == 1:
    return figures
  parts = exchange(tag, dict(figures), timeout_s)
  return {k: float(sum(p.get(k, 0.0) for p in parts)) for k in parts[0]}


def code_version() -> str:
  """A hash of the project's Python files (configs, envs, models, rl): two processes of one
  job must run the same code."""
  h = hashlib.sha256()
  for top in _CODE_DIRS:
    for dirpath, dirnames, files in os.walk(os.path.join(_ROOT, top)):
      dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
      for name in sorted(f for f in files if f.endswith(".py")):
        path = os.path.join(dirpath, name)
        h.update(os.path.relpath(path, _ROOT).encode() + b"\0")
        with open(path, "rb") as f:
          h.update(f.read() + b"\0")
  return h.hexdigest()[:16]


def _flat(config) -> dict:
  """Dotted key -> the value's JSON text, for every leaf of the config."""
  out = {}

  def walk(prefix, node):
    for k, v in node.items():
      if hasattr(v, "items"):
        walk(f"{prefix}{k}.", v)
      else:
        out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True, default=repr)
  walk("", config.to_dict() if hasattr(config, "to_dict") else config)
  return out


def differences(mine: dict, theirs: dict) -> list[str]:
  """Keys whose values differ between two flat configs (one side missing counts)."""
  return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


def check_same_run(config, timeout_s: float | None = None) -> None:
  """Stops every process, with one message naming what differs, unless all run the same
  config and the same code (`code_version`)."""
  if jax.process_count() == 1:
    return
  timeout_s = float(config.distributed.init_timeout_s) if timeout_s is None else timeout_s
  records = exchange("start/run", {"config": _flat(config), "code": code_version()}, timeout_s)
  problems = []
  for p, r in enumerate(records[1:], start=1):
    if r["code"] != records[0]["code"]:
      problems.append(f"process {p} runs other code than process 0 (code version "
                      f"{r['code']} vs {records[0]['code']})")
    keys = differences(r["config"], records[0]["config"])
    if keys:
      shown = ", ".join(f"{k}={r['config'].get(k, '(missing)')} (process 0: "
                        f"{records[0]['config'].get(k, '(missing)')})" for k in keys[:10])
      more = f" and {len(keys) - 10} more" if len(keys) > 10 else ""
      problems.append(f"process {p} runs another config than process 0: {shown}{more}")
  if problems:
    raise SystemExit("every process of one job must run the same command: "
                     + "; ".join(problems))


def host_copy(params):
  """`params` whole on this process (numpy), for an engine on this process's own devices; with
  one process, `params` as they are (the engine then copies them device to device). A
  collective: every process calls it at the same point. It moves each host the bytes of the
  shards it does not hold (`--mode=plan` and benchmarks/pod_scaling.py size it)."""
  if jax.process_count() == 1:
    return params
  return multihost_utils.process_allgather(params, tiled=True)


def replicated(tree):
  """Process-local arrays holding the same values on every process (e.g. what SFT trained on
  each) as global arrays replicated over every device, which multi-process orbax saves and the
  train state's shardings take; with one process, `tree` as it is."""
  if jax.process_count() == 1:
    return tree
  everywhere = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices(), ("all",)),
                                          jax.sharding.PartitionSpec())
  # Arrays already global over the job (e.g. params restored with the train step's shardings)
  # stay as they are.
  return jax.tree.map(lambda x: jax.device_put(np.asarray(x), everywhere)
                      if getattr(x, "is_fully_addressable", True) else x, tree)
