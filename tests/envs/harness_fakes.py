"""Fakes for the harness tests: a world in its own process, scripted policies.

`FakeWorldSpec` starts `fake_world_server.py` as a child process (so it can hang, crash and
be killed like a real MCP gateway). Policies here are token-level scripted policies: they
write Qwen3.5 text, tokenized, and read only their context ids.
"""
import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from typing import Any

import ml_collections

from envs.harness.errors import WorldCrashed
from envs.harness.policy import Action
from envs.harness.policy import Observation
from envs.harness.policy import ScriptedPolicy
from envs.harness.world import Grade
from envs.harness.world import ToolResult
from envs.tasks import rubric
from envs.tasks.task import Task

_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_world_server.py")


@dataclasses.dataclass(frozen=True)
class FakeWorldSpec:
  """A key-value world; the task is answered by looking up `answer_key`.

  Attributes:
    facts: key -> value served by the `lookup` tool.
    answer: the expected final answer (graded by exact match).
    start_delay_s: the world takes this long to start (world-start timeout tests).
  """
  facts: tuple[tuple[str, str], ...] = ()
  answer: str = ""
  start_delay_s: float = 0.0

  def start(self) -> "FakeWorld":
    if self.start_delay_s:
      time.sleep(self.start_delay_s)
    return FakeWorld(self)


class FakeWorld:
  """Client side of the fake world process."""

  def __init__(self, spec: FakeWorldSpec):
    self.spec = spec
    self.proc = subprocess.Popen(
        [sys.executable, "-u", _SERVER, json.dumps(dict(spec.facts))], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, bufsize=1)

  @property
  def pid(self) -> int:
    return self.proc.pid

  def _request(self, req: dict[str, Any]) -> dict[str, Any]:
    try:
      self.proc.stdin.write(json.dumps(req) + "\n")
      self.proc.stdin.flush()
      line = self.proc.stdout.readline()
    except (BrokenPipeError, OSError, ValueError) as e:
      raise WorldCrashed(f"world process {self.proc.pid} is gone: {e}") from e
    if not line:
      code = self.proc.poll()
      raise WorldCrashed(f"world process {self.proc.pid} closed its output (exit code {code})")
    return json.loads(line)

  def tools(self):
    return self._request({"method": "tools"})["tools"]

  def call_tool(self, name, arguments):
    reply = self._request({"method": "call", "name": name, "arguments": arguments})
    return ToolResult(reply["text"], reply["is_error"])

  def grade(self, final_answer: str) -> Grade:
    ok = final_answer.strip() == self.spec.answer
    return Grade(float(ok), ok, {"expected": self.spec.answer})

  def close(self, reuse: bool = False):
    del reuse  # a fake world is cheap: always a fresh process
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait(5)
    for f in (self.proc.stdin, self.proc.stdout):
      try:
        f.close()
      except OSError:
        pass


@dataclasses.dataclass(frozen=True)
class JudgedWorldSpec(FakeWorldSpec):
  """A fake world graded by a task's rubric, judge criteria included (envs/judge.py).

  Attributes:
    task_json: the envs.tasks.Task whose rubric grades the final answer.
    envs_json: config.envs as JSON (its `judge` section reaches the judge).
  """
  task_json: str = ""
  envs_json: str = ""

  def start(self) -> "JudgedWorld":
    return JudgedWorld(self)


class JudgedWorld(FakeWorld):
  """The fake world's tools; grading by rubric.grade (no world files: nothing changed)."""

  def grade(self, final_answer: str) -> Grade:
    task = Task.from_json(self.spec.task_json)
    cfg = ml_collections.ConfigDict(json.loads(self.spec.envs_json))
    g = rubric.grade(task, final_answer, "", "", cfg)
    return Grade(g.reward, g.passed, {"criteria": [dataclasses.asdict(r) for r in g.results]})


_KEY_RE = re.compile(r"under the key (\S+?)\?")


def lookup_task(key: str) -> str:
  return f"What is the value stored under the key {key}?"


class LookupOracle(ScriptedPolicy):
  """Solves lookup tasks: one `lookup` call, then the value as the final answer."""

  def act(self, obs: Observation) -> Action:
    key = _KEY_RE.search(obs.task).group(1)
    if not obs.results:
      return Action(reasoning=f"I need the value under {key}.",
                    tool_calls=[{"name": "lookup", "arguments": {"key": key}}])
    return Action(reasoning="I have it.", content=obs.results[-1][-1].split("\n\n")[0])


# Special scripts that act on the policy side rather than writing text.
HANG_ENGINE = "hang_engine"     # the engine stops answering
ENGINE_RAISES = "engine_raises"  # the client raises (connection refused, ...)
KILL_AGENT = "kill_agent"        # the agent-loop process itself dies


class TaskScriptPolicy(ScriptedPolicy):
  """Plays a fixed script per task: turn i plays `scripts[task][i]`.

  Args:
    fmt: the chat format.
    scripts: task prompt -> list of Actions (or one of the special strings above); tasks
      not listed are solved by the lookup oracle.
  """

  def __init__(self, fmt, scripts: dict[str, Any] | None = None):
    super().__init__(fmt)
    self.scripts = scripts or {}
    self._oracle = LookupOracle(fmt)

  def generate(self, prompt_ids, sampling, max_tokens, stop_ids):
    obs = self.read(prompt_ids)
    script = self.scripts.get(obs.task)
    if script == HANG_ENGINE:
      time.sleep(3600)
    if script == ENGINE_RAISES:
      raise ConnectionError("engine unreachable")
    if script == KILL_AGENT:
      os._exit(3)
    return super().generate(prompt_ids, sampling, max_tokens, stop_ids)

  def act(self, obs: Observation) -> Action:
    script = self.scripts.get(obs.task)
    if script is None:
      return self._oracle.act(obs)
    turn = len(obs.results)
    return script[min(turn, len(script) - 1)]


class UniformRandomPolicy:
  """What an untrained model looks like to the harness: uniformly random ids.

  Each id is drawn from the whole vocabulary (control ids included) with its exact logprob
  -log(V); the draw stops at a stop id or max_tokens. Seeded per call from the context, so a
  run is reproducible.
  """

  def __init__(self, fmt, stop_bias: float = 0.0):
    self.fmt = fmt
    self.vocab = fmt.tok.vocab_size
    self.stop_bias = stop_bias  # extra probability of ending the turn at each step

  def generate(self, prompt_ids, sampling, max_tokens, stop_ids):
    rng = random.Random(hash((tuple(prompt_ids[-64:]), len(prompt_ids), sampling.seed)))
    ids, lps = [], []
    p_stop = self.stop_bias + (1 - self.stop_bias) * len(stop_ids) / self.vocab
    for _ in range(max_tokens):
      if rng.random() < p_stop:
        tok = stop_ids[0]
        lp = math.log(p_stop / len(stop_ids))
      else:
        tok = rng.randrange(self.vocab)
        while tok in stop_ids:
          tok = rng.randrange(self.vocab)
        lp = math.log((1 - p_stop) / (self.vocab - len(stop_ids)))
      ids.append(tok)
      lps.append(lp)
      if tok in stop_ids:
        return ids, lps, "stop"
    return ids, lps, "length"
