"""What the agent loop needs from a world, and the episode and result records.

A `WorldSpec` is a small picklable description that travels to the agent-loop process and
starts the world there (for the real worlds: one MCP gateway process). The loop never waits
on a world without a deadline: every method is called through `call_with_timeout`.
"""
import dataclasses
import threading
from typing import Any, Callable, Protocol

from envs.harness.errors import CallTimeout


@dataclasses.dataclass
class ToolResult:
  text: str
  is_error: bool = False


@dataclasses.dataclass
class Grade:
  reward: float               # share of rubric criteria passed
  passed: bool                # every criterion passed
  details: dict[str, Any] = dataclasses.field(default_factory=dict)


class World(Protocol):
  """A started world, for one episode."""

  def tools(self) -> list[dict[str, Any]]:
    """Tool schemas in the OpenAI function shape ({"type": "function", "function": {...}})."""
    ...

  def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
    """Runs a tool; raises `WorldCrashed` when the world process or transport is gone."""
    ...

  def grade(self, final_answer: str) -> Grade:
    ...

  def close(self, reuse: bool = False) -> None:
    """Ends the episode in this world; must not block for long.

    Args:
      reuse: the episode ended cleanly; the world may keep its process for the next episode
        of the same world in this agent-loop process. When False, kill it.
    """
    ...


class WorldSpec(Protocol):
  def start(self) -> World:
    ...


@dataclasses.dataclass
class Episode:
  """One rollout to run: a task in a world, one sample of a group."""
  task_id: str
  prompt: str
  world: Any                  # a WorldSpec
  group_id: int = 0
  sample_index: int = 0
  system_prompt: str = ""
  seed: int | None = None     # sampling seed for this rollout
  temperature: float | None = None  # sampling temperature; None = the loop's (rl.temperature)
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class EpisodeResult:
  """What one episode produced: the trajectory, its outcome and where the time went."""
  task_id: str
  group_id: int
  sample_index: int
  outcome: str
  detail: str = ""
  tokens: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  rollout_logprobs: list[float] = dataclasses.field(default_factory=list)
  prompt_len: int = 0
  reward: float = 0.0
  passed: bool = False
  grade_details: dict[str, Any] = dataclasses.field(default_factory=dict)
  final_answer: str = ""
  turns: int = 0
  events: dict[str, int] = dataclasses.field(default_factory=dict)
  timing: dict[str, float] = dataclasses.field(default_factory=dict)
  tainted: bool = False       # a guarded call may still be running: recycle the process
  worker_pid: int = 0
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)


def call_with_timeout(fn: Callable[[], Any], timeout: float, what: str = "call") -> Any:
  """Runs `fn()` in a daemon thread and waits at most `timeout` seconds.

  A call that does not return in time raises `CallTimeout` and is abandoned: its thread may
  live on (the caller recycles the process); exceptions from `fn` propagate unchanged.
  """
  if timeout <= 0:
    raise CallTimeout(f"{what}: no time left")
  box: dict[str, Any] = {}
  done = threading.Event()

  def run():
    try:
      box["value"] = fn()
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
      box["error"] = e
    finally:
      done.set()

  threading.Thread(target=run, name=f"guarded-{what}", daemon=True).start()
  if not done.wait(timeout):
    raise CallTimeout(f"{what} did not return within {timeout:.3g}s")
  if "error" in box:
    raise box["error"]
  return box["value"]


_EXIT_HOOKS: list[Callable[[], None]] = []


def register_exit_hook(fn: Callable[[], None]) -> None:
  """Runs `fn` when this agent-loop process leaves its loop (worlds release their processes
  and working copies); multiprocessing workers skip atexit, hence this registry."""
  if fn not in _EXIT_HOOKS:
    _EXIT_HOOKS.append(fn)


def run_exit_hooks() -> None:
  for fn in _EXIT_HOOKS:
    try:
      fn()
    except Exception:  # noqa: BLE001 - best effort at exit
      pass
