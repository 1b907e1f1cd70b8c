"""The oracle as a token-level policy: it writes its tool calls as Qwen3.5 text.

Each task carries a known-good solution (envs.tasks.Task.oracle_steps and oracle_answer).
This policy finds the task from the first user turn of its context ids, then at turn i
writes step i as a Qwen3-Coder XML tool call (or the answer once the steps are done). Its
output is tokenized and goes through exactly the parsing, tool dispatch, TITO accounting and
grading a model's would, so 100% through the harness means the harness loses nothing.

Both tool styles (config.harness.style): the app tools' steps as the task gives them (mcp), or
their translation into bash, read, grep, ... calls (shell; envs.tasks.shell_oracle). With
style "auto" the policy reads the style from the tools its system turn offers, as a model
would; the answer is the same.
"""
import functools

from envs import tasks as tasks_lib
from envs.apps import shell_tools
from envs.harness.policy import Action
from envs.harness.policy import Observation
from envs.harness.policy import ScriptedPolicy
from envs.tasks import shell_oracle

_SHELL_MARK = '"name": "bash"'  # how the shell tool set shows in the system turn's tool JSON


class OraclePolicy(ScriptedPolicy):
  """Args: fmt, the chat format; tasks, the envs.tasks.Task list it may be asked about; style,
  the tools it calls: mcp | shell | auto (from the tools its context offers).

  `plans` maps a task prompt to its MCP plan (steps, answer); `shell_plans` to its shell one.
  """

  def __init__(self, fmt, tasks, style: str = "auto"):
    super().__init__(fmt)
    if style != "auto":
      shell_tools.check_style(style)
    self.style = style
    self.plans: dict[str, tuple] = {}
    self.shell_plans: dict[str, tuple] = {}
    for t in tasks:
      plan = (tuple((s["name"], dict(s["args"])) for s in t.oracle_steps), t.oracle_answer)
      if self.plans.setdefault(t.prompt.strip(), plan) != plan:
        raise ValueError(f"two tasks share the prompt {t.prompt[:60]!r} but not the solution")
      try:
        self.shell_plans[t.prompt.strip()] = (
            tuple((s["name"], s["args"]) for s in shell_oracle.shell_steps(t)), t.oracle_answer)
      except ValueError:
        pass  # tools with no shell translation (an external MCP server's): the MCP plan only
    self._context_style = "mcp"

  def read(self, prompt_ids) -> Observation:
    obs = super().read(prompt_ids)
    if self.style == "auto":
      ids = list(prompt_ids)
      end = ids.index(self.sp.im_end) if self.sp.im_end in ids else len(ids)
      system = self.tok.decode(ids[:end]) if ids[:1] == [self.sp.im_start] else ""
      self._context_style = "shell" if _SHELL_MARK in system else "mcp"
    return obs

  def plan(self, task: str) -> tuple:
    """(steps, answer) for the task prompt, in the style in effect."""
    style = self._context_style if self.style == "auto" else self.style
    if style == "shell" and task in self.plans and task not in self.shell_plans:
      raise ValueError(f"the oracle of task {task[:60]!r} calls tools with no shell translation")
    return (self.shell_plans if style == "shell" else self.plans)[task]

  def act(self, obs: Observation) -> Action:
    steps, answer = self.plan(obs.task)
    i = len(obs.results)
    if i < len(steps):
      name, args = steps[i]
      return Action(reasoning=f"Step {i + 1} of {len(steps)}: call {name}.",
                    tool_calls=[{"name": name, "arguments": args}])
    return Action(reasoning="I have everything I need.", content=answer)


def oracle_factory(tasks_json: list[str], style: str = "auto"):
  """A picklable factory for the pool: tasks travel as JSON."""
  if style != "auto":
    shell_tools.check_style(style)
  return functools.partial(_build, tuple(tasks_json), style)


def _build(tasks_json, style, fmt):
  return OraclePolicy(fmt, [tasks_lib.Task.from_json(s) for s in tasks_json], style)
