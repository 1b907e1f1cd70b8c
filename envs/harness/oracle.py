"""The oracle as a token-level policy: it writes its tool calls as Qwen3.5 text.

Each task carries a known-good solution (envs.tasks.Task.oracle_steps and oracle_answer).
This policy finds the task from the first user turn of its context ids, then at turn i
writes step i as a Qwen3-Coder XML tool call (or the answer once the steps are done). Its
output is tokenized and goes through exactly the parsing, tool dispatch, TITO accounting and
grading a model's would, so 100% through the harness means the harness loses nothing.
"""
import functools

from envs import tasks as tasks_lib
from envs.harness.policy import Action
from envs.harness.policy import Observation
from envs.harness.policy import ScriptedPolicy


class OraclePolicy(ScriptedPolicy):
  """Args: fmt, the chat format; tasks, the envs.tasks.Task list it may be asked about."""

  def __init__(self, fmt, tasks):
    super().__init__(fmt)
    self.plans: dict[str, tuple] = {}
    for t in tasks:
      plan = (tuple((s["name"], dict(s["args"])) for s in t.oracle_steps), t.oracle_answer)
      if self.plans.setdefault(t.prompt.strip(), plan) != plan:
        raise ValueError(f"two tasks share the prompt {t.prompt[:60]!r} but not the solution")

  def act(self, obs: Observation) -> Action:
    steps, answer = self.plans[obs.task]
    i = len(obs.results)
    if i < len(steps):
      name, args = steps[i]
      return Action(reasoning=f"Step {i + 1} of {len(steps)}: call {name}.",
                    tool_calls=[{"name": name, "arguments": args}])
    return Action(reasoning="I have everything I need.", content=answer)


def oracle_factory(tasks_json: list[str]):
  """A picklable factory for the pool: tasks travel as JSON."""
  return functools.partial(_build, tuple(tasks_json))


def _build(tasks_json, fmt):
  return OraclePolicy(fmt, [tasks_lib.Task.from_json(s) for s in tasks_json])
