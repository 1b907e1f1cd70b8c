"""A run directory holds one run: the config and code it started with, and each change since.

launch.py calls `guard(config, mode)` after the resolved config is printed and before the mode
runs. For each directory the mode is about to write into it compares the resolved config
(configs/record.flat) with the one recorded there:

  run directory  runs/<name> (workdir/name), for --mode=rl and --mode=sft: every key.
  SFT directory  sft.dir (default runs/<name>/sft) when SFT is about to train into it
                 (--mode=sft; --mode=rl and --mode=pass_rates when it holds no params yet):
                 the keys SFT reads (SFT_KEYS). A run that only reads the params there (the arms
                 of a sweep share one SFT directory) is not compared; rl/sft.py's check of the
                 start weights' fingerprint still applies.

and then:

  - nothing recorded, directory empty or absent: a new run; the config is recorded.
  - the same config: resume.
  - differences only in SAFE keys (where files go, how often things are saved, logged or
    evaluated, timeouts, a longer run with a schedule that does not follow its length):
    resume, each change printed and appended to the history.
  - any other difference: refuse before anything is written (configs/validate.ConfigError,
    exit code 2), naming each key with both values and the two ways on: another
    --config.name, or --config.resume=changed, which continues the run with this config and
    records the change in the history.
  - files there but nothing recorded (a directory from before records existed): adopted; its
    earlier config is unknown, this one is recorded from now on.

Files, written by process 0 only:

  run_config.json    {"config": {key: resolved value}, "config_hash", "code", "started", "updated"}
  run_history.jsonl  one line per launch that went on: what it did, its mode, config hash, code
                     version and the changes it brought (key, recorded value, new value, why
                     accepted).

The code version is the git commit (and whether tracked files differ from it) where there is a
repository, and always a hash of the project's Python files (rl/distributed.code_version); a
change of code between launches is printed and recorded, never refused (code moves under a
long run). summary.json carries `config_hash(config)` (rl/evaluation.finish_summary).

On a pod every process runs the same command (rl/distributed.check_same_run): process 0 decides
from what it reads and every process takes its decision, so all go on or all refuse alike.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import subprocess
from typing import Any

from configs import base
from configs import record
from configs.validate import ConfigError
from rl import distributed
from rl.run_files import run_dir
from rl.run_files import sft_dir
from rl.run_files import starts_from_sft

# The modes that write into a run or SFT directory (`directories`).
WRITERS = ("rl", "sft", "pass_rates")
RECORD = "run_config.json"
HISTORY = "run_history.jsonl"

# Keys that may change between launches on one run directory, and why each is safe: none of
# them changes what the run computes, only where its files go, what is logged, how often it
# saves or evaluates, and how long processes wait. train.steps is safe when it grows and the
# learning-rate schedule does not follow it (`_steps_change`).
SAFE = {
    "name": "names this directory",
    "workdir": "names this directory's parent",
    "resume": "says how a change is handled",
    "jax_cache_dir": "the compilation cache (the same programs)",
    "jax_cache_min_compile_s": "the compilation cache (the same programs)",
    "envs.worlds_root": "where rendered worlds are cached (the same worlds)",
    "envs.generation_workers": "processes rendering the worlds (the same bytes)",
    "loop.eval_every": "the cadence of held-out evals during RL (points on the curve)",
    "loop.progress": "console progress bars",
    "loop.tensorboard": "TensorBoard events (metrics.jsonl has every figure)",
    "train.log_every": "how often SFT logs",
    "checkpoint.save_every": "how often the state is saved (a resume continues exactly)",
    "checkpoint.keep": "how many checkpoints are kept",
    "checkpoint.async_save": "whether saves are written in the background",
    "sft.save_every": "how often SFT params are saved",
    "sft.eval_every": "how often SFT's held-out figures are logged",
    "sft.eval_tasks": "the tasks of SFT's held-out figures (logged only)",
    "sft.export_hf": "where a Hugging Face copy of the SFT result is written",
    "lora.export_dir": "where the LoRA run's Hugging Face exports are written at its end",
    "rollout.port": "the port of the in-process rollout server",
    "rollout.address": "where the token client finds the rollout server",
    "rollout.log_level": "the log level",
    "distributed.heartbeat_timeout_s": "how long a pod waits on a silent process",
    "distributed.init_timeout_s": "how long a pod's processes wait for each other at start",
    "distributed.exchange_timeout_s": "how long a pod's processes wait for each other's work",
}
SAFE_PREFIXES = {
    "plan.": "read by --mode=plan only",
    "compile.": "read by --mode=compile only",
}
# What SFT reads (rl/sft.py: the oracle's episodes through the harness on the worlds, the
# model, the optimizer knobs it shares with RL, the start weights): the keys an SFT directory
# compares. Safe keys among them are safe there too.
SFT_KEYS = ("seed", "model.", "mesh.", "tokenizer.", "envs.", "harness.", "sft.",
            "optim.b1", "optim.b2", "optim.eps", "optim.weight_decay", "optim.grad_clip",
            "train.init_from", "train.xla_cpu_dots", "train.max_context", "train.seq_len",
            "train.log_every", "loop.tools", "loop.tool_schema", "sft.dir")
# Left out of `config_hash`: where the run's files go and the resume switch, so that the same
# config run under another name or directory hashes the same.
UNHASHED = ("name", "workdir", "resume", "jax_cache_dir", "envs.worlds_root")
SFT_LOCATION = "sft.dir"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def normalized(config) -> dict:
  """The resolved config (configs/record.flat) as JSON reads it back: tuples as lists."""
  return json.loads(json.dumps(record.flat(config), default=repr))


def config_hash(config) -> str:
  """16 hex digits of sha256 over the resolved config, less UNHASHED."""
  flat = {k: v for k, v in normalized(config).items() if k not in UNHASHED}
  return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:16]


def _git(*args) -> str | None:
  try:
    out = subprocess.run(["git", "-C", _ROOT, *args], capture_output=True,
                         text=True, timeout=10, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() if out.returncode == 0 else None


def code_version() -> dict:
  """{"git_commit", "git_modified", "sources"}: the commit checked out (None outside a git
  repository), whether tracked files differ from it, and a hash of the project's Python files
  ("unknown" if they cannot be read)."""
  commit = _git("rev-parse", "HEAD")
  modified = None if commit is None else bool(
      _git("status", "--porcelain", "--untracked-files=no"))
  try:
    sources = distributed.code_version()
  except OSError:
    sources = "unknown"
  return {"git_commit": commit, "git_modified": modified, "sources": sources}


def describe_code(code: dict) -> str:
  if code.get("git_commit"):
    return f"git {code['git_commit'][:12]}" + (" with local changes" if code.get("git_modified")
                                                else "")
  return f"sources {code.get('sources', 'unknown')}"


@dataclasses.dataclass
class Change:
  """One key whose value differs from the recorded one; `why` says why it is safe (safe) or
  what makes it unsafe (may be "")."""
  key: str
  was: Any
  now: Any
  safe: bool
  why: str = ""

  def line(self) -> str:
    return (f"{self.key}: {_text(self.was)} -> {_text(self.now)}"
            + (f" ({self.why})" if self.why else ""))


_ABSENT = "(not a key then)"
_GONE = "(no longer a key)"


def _text(v) -> str:
  return v if v in (_ABSENT, _GONE) else json.dumps(v)


def _relevant(kind: str, key: str) -> bool:
  return kind == "run" or key.startswith(SFT_KEYS)


def _steps_change(was, now, config) -> tuple[bool, str]:
  if now < was:
    return False, "shortens the run"
  if config.optim.schedule == "cosine" and not config.optim.decay_steps:
    return False, ("the cosine schedule's length follows train.steps while optim.decay_steps=0: "
                   "set optim.decay_steps to keep the schedule")
  return True, "extends the run"


def changes(saved: dict, now: dict, kind: str, config) -> list[Change]:
  """The keys of `kind` ("run": all; "sft": SFT_KEYS) whose values differ between the recorded
  flat config `saved` and `now` (both `normalized`), each marked safe or not."""
  defaults = normalized(base.get_config())
  out = []
  for key in sorted(set(saved) | set(now)):
    if not _relevant(kind, key):
      continue
    was, cur = saved.get(key, _ABSENT), now.get(key, _GONE)
    if was == cur and type(was) is type(cur):
      continue
    if key == "train.steps" and was != _ABSENT and cur != _GONE:
      safe, why = _steps_change(was, cur, config)
    elif key in SAFE:
      safe, why = True, SAFE[key]
    elif kind == "sft" and key == SFT_LOCATION:
      safe, why = True, "names this directory"
    elif key.startswith(tuple(SAFE_PREFIXES)):
      safe, why = True, SAFE_PREFIXES[next(p for p in SAFE_PREFIXES if key.startswith(p))]
    elif was is _ABSENT:
      safe = cur == defaults.get(key, _GONE)
      why = "added since, at its configs/base.py default" if safe else "added since"
    elif cur is _GONE:
      safe, why = True, "no longer read"
    else:
      safe, why = False, ""
    out.append(Change(key, was, cur, safe, why))
  return out


@dataclasses.dataclass
class Verdict:
  """What one directory's check decided: `action` is start | resume | adopt | refuse."""
  directory: str
  kind: str
  action: str
  changes: list
  code_was: dict | None = None

  @property
  def unsafe(self) -> list:
    return [c for c in self.changes if not c.safe]


def holds_saves(directory: str) -> bool:
  """Whether `directory` holds orbax saves (step-numbered subdirectories)."""
  return os.path.isdir(directory) and any(
      d.isdigit() and os.path.isdir(os.path.join(directory, d)) for d in os.listdir(directory))


def directories(config, mode: str) -> list[tuple[str, str]]:
  """(directory, kind) of each directory `mode` is about to write into and that keeps a
  record: the run directory for rl and sft, the SFT directory where SFT will train (unless it
  lies in that run directory, whose record holds every key)."""
  out = []
  rdir, sdir = os.path.abspath(run_dir(config)), os.path.abspath(sft_dir(config))
  if mode in ("rl", "sft"):
    out.append((run_dir(config), "run"))
    if os.path.commonpath([rdir, sdir]) == rdir:
      return out
  trains_sft = mode == "sft" or (
      mode in ("rl", "pass_rates") and starts_from_sft(config) and not holds_saves(sdir))
  if trains_sft:
    out.append((sft_dir(config), "sft"))
  return out


def read_record(directory: str) -> dict | None:
  """The record in `directory`, or None where there is none."""
  path = os.path.join(directory, RECORD)
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      rec = json.load(f)
    if not isinstance(rec.get("config"), dict):
      raise ValueError("no \"config\" object")
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path} is unreadable ({e}): move it away to adopt the directory, or "
                      "run under another --config.name") from e
  return rec


def check(directory: str, kind: str, config) -> Verdict:
  """What to do with `directory` under `config` (reads only)."""
  rec = read_record(directory)
  if rec is None:
    present = os.path.isdir(directory) and bool(os.listdir(directory))
    return Verdict(directory, kind, "adopt" if present else "start", [])
  found = changes(rec["config"], normalized(config), kind, config)
  refuse = any(not c.safe for c in found) and config.resume != "changed"
  return Verdict(directory, kind, "refuse" if refuse else "resume", found, rec.get("code"))


def _free_name(config) -> str:
  for i in range(2, 1000):
    name = f"{config.name}-{i}"
    if not os.path.exists(os.path.join(config.workdir, name)):
      return name
  return f"{config.name}-new"


def refusal(verdicts: list, config) -> str:
  """The message of a refused start: each directory, each differing key with both values,
  and how to go on."""
  lines = []
  for v in verdicts:
    what = "a run" if v.kind == "run" else "SFT params"
    lines.append(f"{v.directory} holds {what} of another config; nothing was written. "
                 f"Keys that differ (recorded -> this command):")
    lines += [f"  {c.line()}" for c in v.unsafe]
    safe = [c for c in v.changes if c.safe]
    if safe:
      lines.append("  and, safe to change on resume: " + "; ".join(c.line() for c in safe))
  where = ", ".join(os.path.join(v.directory, HISTORY) for v in verdicts)
  lines.append(f"To start a new run, give it another name (--config.name={_free_name(config)}"
               + (", or another --config.sft.dir" if any(v.kind == "sft" for v in verdicts)
                  else "")
               + f"); to continue this one with the change, recorded in {where}: "
               "--config.resume=changed. Keys safe to change on resume: docs/training.md, "
               "\"Checkpoints and resume\".")
  return "\n".join(lines)


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: str, obj) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


def commit(v: Verdict, config, mode: str, code: dict) -> str:
  """Writes `v`'s directory's record and history line (process 0); returns the console line."""
  os.makedirs(v.directory, exist_ok=True)
  path = os.path.join(v.directory, RECORD)
  old = read_record(v.directory) or {}
  now = _now()
  h = config_hash(config)
  _write_json(path, {"config": normalized(config), "config_hash": h, "code": code,
                     "started": old.get("started", now), "updated": now})
  entry = {"time": now, "event": v.action, "mode": mode, "config_hash": h, "code": code}
  if v.changes:
    entry["changes"] = [{"key": c.key, "was": c.was, "now": c.now,
                         "accepted": c.why if c.safe else "--config.resume=changed"}
                        for c in v.changes]
  code_changed = v.code_was is not None and v.code_was.get("sources") != code.get("sources")
  if code_changed:
    entry["code_was"] = v.code_was
  with open(os.path.join(v.directory, HISTORY), "a", encoding="utf-8") as f:
    f.write(json.dumps(entry, sort_keys=True) + "\n")
  name = "run directory" if v.kind == "run" else "SFT directory"
  if v.action == "start":
    line = f"{name} {v.directory}: new; config {h} recorded in {RECORD}"
  elif v.action == "adopt":
    line = (f"{name} {v.directory}: holds files but no record (made before records existed); "
            f"its earlier config is unknown, config {h} is recorded from now on")
  elif v.changes:
    line = (f"{name} {v.directory}: resuming with {len(v.changes)} changed "
            f"key{'s' if len(v.changes) > 1 else ''} (recorded in {HISTORY}): "
            + "; ".join(c.line() if c.safe else f"{c.line()} (--config.resume=changed)"
                        for c in v.changes))
  else:
    line = f"{name} {v.directory}: same config as recorded ({h}), resuming"
  if code_changed:
    line += (f"\n{name} {v.directory}: code changed since the last launch "
             f"({describe_code(v.code_was)} -> {describe_code(code)}); recorded")
  return line


def guard(config, mode: str) -> list[Verdict]:
  """Checks every directory `mode` will write into; raises ConfigError (every process alike)
  when one holds a run of another config, else records the config there (process 0) and
  prints what it found. Returns the verdicts."""
  if mode not in WRITERS:
    return []   # nothing to check; and no JAX backend started for it (--mode=compile sets its own)
  decided = None
  if distributed.is_writer():
    try:
      decided = [check(d, kind, config) for d, kind in directories(config, mode)]
    except ConfigError as e:
      decided = str(e)
  # Process 0 reads; every process takes its decision.
  decided = distributed.exchange("start/run_record", decided,
                                 float(config.distributed.init_timeout_s))[0]
  if isinstance(decided, str):
    raise ConfigError(decided)
  refused = [v for v in decided if v.action == "refuse"]
  if refused:
    raise ConfigError(refusal(refused, config))
  if distributed.is_writer() and decided:
    code = code_version()
    for v in decided:
      print(commit(v, config, mode, code), flush=True)
  return decided
