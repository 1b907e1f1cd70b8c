"""The agent loop: one episode, token-in/token-out, every call under a deadline.

  prompt ids -> policy (ids in; sampled ids + logprobs out) -> parse tool calls from the
  sampled ids -> world tools -> observation ids appended -> ... until a final answer,
  max_turns, the context limit or a failure. Then the world is graded.

The trajectory is append-only (envs.harness.trajectory): sampled ids with their logprobs
(loss mask 1) and harness-built ids (mask 0). Every way out of the loop is an outcome of the
taxonomy in envs.harness.errors; anything unexpected is a `harness_bug` with its traceback,
never an exception that takes the batch down.
"""
import dataclasses
import os
import time
import traceback
from typing import Any

from envs import judge as judge_lib
from envs.chat.format import ChatFormat
from envs.harness import errors
from envs.harness.errors import CallTimeout
from envs.harness.errors import MalformedResult
from envs.harness.errors import EpisodeError
from envs.harness.errors import ToolTimeout
from envs.harness.errors import WorldCrashed
from envs.harness.policy import FINISH_LENGTH
from envs.harness.policy import FINISH_REASONS
from envs.harness.policy import SamplingParams
from envs.harness.trajectory import Trajectory
from envs.harness.world import Episode
from envs.harness.world import EpisodeResult
from envs.harness.world import call_with_timeout

NUDGE_TEXT = ("[Notice from the system] Your context is almost full: about {left} tokens are "
              "left. Do not call more tools; give your final answer now.")
REPAIR_BAD_CALL = ("Error: your tool call could not be parsed: {reason}. Write each call as "
                   "one <function=NAME> block of <parameter=ARG> blocks inside tool-call tags, "
                   "in the format given in the system prompt, or answer without calling a tool.")
REPAIR_UNKNOWN_TOOL = ("Error: there is no tool named {names}. Available tools: {tools}.")


@dataclasses.dataclass(frozen=True)
class LoopSettings:
  """The knobs of the agent loop, read once from the config (picklable for the workers)."""
  max_turns: int
  max_context: int
  max_tokens_per_turn: int
  repair_attempts: int
  nudge: bool
  nudge_fraction: float
  nudge_once: bool
  world_start_timeout_s: float
  model_timeout_s: float
  tool_timeout_s: float
  grade_timeout_s: float
  episode_timeout_s: float
  temperature: float
  top_p: float
  top_k: int

  @classmethod
  def from_config(cls, c) -> "LoopSettings":
    h = c.harness
    return cls(
        max_turns=h.max_turns, max_context=c.train.max_context,
        max_tokens_per_turn=h.max_tokens_per_turn, repair_attempts=h.repair_attempts,
        nudge=h.nudge, nudge_fraction=h.nudge_fraction, nudge_once=h.nudge_once,
        world_start_timeout_s=h.world_start_timeout_s, model_timeout_s=h.model_timeout_s,
        tool_timeout_s=h.tool_timeout_s, grade_timeout_s=h.grade_timeout_s,
        episode_timeout_s=h.episode_timeout_s, temperature=c.rl.temperature,
        top_p=c.rollout.top_p, top_k=c.rollout.top_k)


class _Clock:
  """The episode deadline, and the time spent in each kind of call."""

  def __init__(self, budget_s: float):
    self.start = time.monotonic()
    self.deadline = self.start + budget_s
    self.spent: dict[str, float] = {}

  def remaining(self) -> float:
    return self.deadline - time.monotonic()

  def guarded(self, kind: str, fn, limit_s: float, on_timeout: str, what: str):
    """Runs fn under min(limit, time left); a timeout becomes `on_timeout` or, when the
    episode deadline was the binding one, `episode_timeout`."""
    left = self.remaining()
    if left <= 0:
      raise EpisodeError(errors.EPISODE_TIMEOUT, f"no time left before {what}")
    t0 = time.monotonic()
    try:
      return call_with_timeout(fn, min(limit_s, left), what)
    except CallTimeout as e:
      if left < limit_s:
        raise EpisodeError(errors.EPISODE_TIMEOUT, f"episode deadline reached during {what}") from e
      raise EpisodeError(on_timeout, str(e)) from e
    finally:
      self.spent[kind] = self.spent.get(kind, 0.0) + time.monotonic() - t0


def _schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  out = {}
  for t in tools:
    f = t.get("function", t)
    out[f["name"]] = f.get("parameters") or {}
  return out


def _check_sample(ids, logprobs, finish, max_tokens: int, vocab_size: int) -> None:
  if finish not in FINISH_REASONS:
    raise EpisodeError(errors.ENGINE_ERROR, f"unknown finish reason {finish!r}")
  if not ids:
    raise EpisodeError(errors.ENGINE_ERROR, "the engine returned no tokens")
  if len(ids) != len(logprobs):
    raise EpisodeError(errors.ENGINE_ERROR, f"{len(ids)} ids but {len(logprobs)} logprobs")
  if len(ids) > max_tokens:
    raise EpisodeError(errors.ENGINE_ERROR, f"{len(ids)} ids returned for max_tokens={max_tokens}")
  bad = [i for i in ids if not 0 <= int(i) < vocab_size]
  if bad:
    raise EpisodeError(errors.ENGINE_ERROR, f"out-of-vocabulary ids {bad[:5]}")


def count_judge_errors(res: EpisodeResult) -> int:
  """Records the criteria the judge could not decide: `grade_details["judge_error"]` and the
  event `judge_error` (nothing when there are none)."""
  crit = res.grade_details.get("criteria") or []
  n = sum(isinstance(c, dict) and str(c.get("detail", "")).startswith(errors.JUDGE_ERROR)
          for c in crit)
  if n:
    res.grade_details["judge_error"] = n
    res.events[errors.JUDGE_ERROR] = n
  return n


def apply_verdicts(res: EpisodeResult, update: dict) -> EpisodeResult:
  """Completes a result graded with its judge verdicts pending (`run_episode`'s judge_sink)
  with the final grade: {reward, passed, criteria: {rubric index: criterion dict}}."""
  res.reward, res.passed = float(update["reward"]), bool(update["passed"])
  crit = res.grade_details.get("criteria")
  for i, c in update.get("criteria", {}).items():
    if isinstance(crit, list) and int(i) < len(crit):
      crit[int(i)] = dict(c)
  count_judge_errors(res)
  return res


def unjudged(res: EpisodeResult, why: str) -> EpisodeResult:
  """Completes a result whose pending verdicts will never come: every pending judge criterion
  is a judge error (not met); the provisional reward, which counted them not met, stands."""
  for c in res.grade_details.get("criteria") or []:
    if isinstance(c, dict) and c.get("detail") == "judge pending":
      c["detail"] = f"{errors.JUDGE_ERROR}: {why}"
  res.passed = False
  count_judge_errors(res)
  return res


@dataclasses.dataclass
class _Run:
  """One episode's state while `run_episode` takes it through its steps."""
  episode: Episode
  policy: Any
  fmt: ChatFormat
  s: LoopSettings
  clock: _Clock
  res: EpisodeResult
  events: dict
  world: Any = None
  schemas: dict = dataclasses.field(default_factory=dict)
  traj: Trajectory | None = None
  sampling: SamplingParams | None = None
  answer: str | None = None
  repairs: int = 0
  nudges: int = 0


def run_episode(episode: Episode, policy, fmt: ChatFormat, s: LoopSettings,
                start_gate=None, judge_sink: list | None = None) -> EpisodeResult:
  """Runs one episode to an outcome; never raises.

  Args:
    episode: what to run.
    policy: the token-in/token-out policy.
    fmt: the chat format.
    s: the loop settings.
    start_gate: optional semaphore shared by the pool's processes that bounds how many
      worlds start at once (a start storm on a busy host would otherwise push every start
      past its timeout). Waiting for it counts against the episode, not the world start.
    judge_sink: a list: judge criteria are submitted, not waited for (envs.judge.deferred);
      the episode's `envs.judge.Pending` is appended to it and the result's reward, passed and
      judge criteria are provisional (not met, "judge pending") until `apply_verdicts`. None =
      the grade is complete when this returns.
  """
  res = EpisodeResult(task_id=episode.task_id, group_id=episode.group_id,
                      sample_index=episode.sample_index, outcome=errors.HARNESS_BUG,
                      worker_pid=os.getpid(), meta=dict(episode.meta))
  run = _Run(episode, policy, fmt, s, _Clock(s.episode_timeout_s), res,
             events={k: 0 for k in errors.EVENTS})
  try:
    _start_world(run, start_gate)
    while not _turn(run):
      pass
  except EpisodeError as e:
    res.outcome, res.detail = e.outcome, e.detail
  except Exception as e:  # noqa: BLE001 - the taxonomy's catch-all, with the evidence
    res.outcome = errors.HARNESS_BUG
    res.detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
  if res.outcome in errors.GRADED and run.world is not None:
    _grade(run, judge_sink)
  if run.world is not None:
    _close_world(run)
  return _finish(run)


def _start_world(run: _Run, start_gate) -> None:
  """Starts the world (behind the pool's start gate), lists its tools, opens the trajectory
  with the prompt."""
  clock, s, episode = run.clock, run.s, run.episode
  gated = False
  if start_gate is not None:
    t0 = time.monotonic()
    gated = start_gate.acquire(timeout=max(clock.remaining(), 0.0))
    clock.spent["start_queue"] = time.monotonic() - t0
    if not gated:
      raise EpisodeError(errors.EPISODE_TIMEOUT, "no time left waiting for a world-start slot")
  try:
    run.world = clock.guarded("world_start", episode.world.start, s.world_start_timeout_s,
                              errors.WORLD_CRASH, "world start")
    tools = clock.guarded("world_start", run.world.tools, s.world_start_timeout_s,
                          errors.WORLD_CRASH, "list tools")
  except EpisodeError:
    # A start abandoned mid-way may still bring up a world process nobody will close:
    # the agent process is recycled, which takes the process group down with it.
    run.res.tainted = True
    raise
  except Exception as e:  # noqa: BLE001 - any failure to start is the world's
    raise EpisodeError(errors.WORLD_CRASH,
                       f"world failed to start: {type(e).__name__}: {e}") from e
  finally:
    if gated:
      start_gate.release()
  run.schemas = _schemas(tools)
  run.traj = Trajectory(run.fmt.prompt_ids(tools, episode.prompt, episode.system_prompt))
  temperature = s.temperature if episode.temperature is None else episode.temperature
  run.sampling = SamplingParams(temperature, s.top_p, s.top_k, episode.seed)


def _turn(run: _Run) -> bool:
  """One assistant turn: sample it, then answer its tool calls (or repair them) with an
  observation. True when the turn is the final answer."""
  ids, finish, max_tokens, left = _sample(run)
  turn = run.fmt.parse(ids, run.schemas)
  if finish == FINISH_LENGTH and max_tokens == left:
    raise EpisodeError(errors.CONTEXT_OVERFLOW, f"turn {run.res.turns} cut by the context limit")
  unknown = [c.name for c in turn.tool_calls if c.name not in run.schemas]
  if turn.error is not None or unknown:
    results = _repair_message(run, turn, unknown)
  elif not turn.tool_calls:
    run.answer = turn.content
    run.res.outcome = errors.OK
    run.traj.append_context(run.fmt.close_turn_ids(ids))
    return True
  else:
    results = _call_tools(run, turn.tool_calls)
  _append_observation(run, ids, results)
  return False


def _sample(run: _Run) -> tuple:
  """The policy's next turn, checked and appended: (ids, finish, max_tokens, tokens left)."""
  s, res, traj = run.s, run.res, run.traj
  if res.turns >= s.max_turns:
    raise EpisodeError(errors.MAX_TURNS, f"{res.turns} turns without a final answer")
  left = s.max_context - len(traj)
  if left <= 0:
    raise EpisodeError(errors.CONTEXT_OVERFLOW, f"context full ({len(traj)} tokens)")
  max_tokens = min(s.max_tokens_per_turn, left)
  prompt = traj.ids()
  try:
    ids, logprobs, finish = run.clock.guarded(
        "model", lambda: run.policy.generate(prompt, run.sampling, max_tokens, run.fmt.stop_ids),
        s.model_timeout_s, errors.ENGINE_ERROR, "model call")
  except EpisodeError as e:
    res.tainted = True  # the abandoned call may still hold a connection or a thread
    raise e
  except Exception as e:  # noqa: BLE001 - the engine's failures are engine errors
    raise EpisodeError(errors.ENGINE_ERROR, f"{type(e).__name__}: {e}") from e
  _check_sample(ids, logprobs, finish, max_tokens, run.fmt.tok.vocab_size)
  traj.append_sampled(ids, logprobs)
  res.turns += 1
  return ids, finish, max_tokens, left


def _repair_message(run: _Run, turn, unknown: list) -> list[str]:
  """The repair message for an unreadable call or an unknown tool; the episode ends instead
  once s.repair_attempts messages were sent."""
  kind = errors.BAD_TOOL_CALL if turn.error is not None else errors.UNKNOWN_TOOL
  run.events[kind] += 1
  if run.repairs >= run.s.repair_attempts:
    why = turn.error.reason if turn.error is not None else f"unknown tool(s) {unknown}"
    raise EpisodeError(kind, f"{why} (after {run.repairs} repair messages)")
  run.repairs += 1
  run.events["repair"] += 1
  if turn.error is not None:
    return [REPAIR_BAD_CALL.format(reason=turn.error.reason)]
  return [REPAIR_UNKNOWN_TOOL.format(names=", ".join(repr(n) for n in unknown),
                                     tools=", ".join(sorted(run.schemas)))]


def _call_tools(run: _Run, calls) -> list[str]:
  """Each tool call's result text, in order, each call under the tool timeout."""
  events, results = run.events, []
  for call in calls:
    try:
      out = run.clock.guarded("tool", lambda c=call: run.world.call_tool(c.name, c.arguments),
                              run.s.tool_timeout_s, errors.TOOL_TIMEOUT, f"tool {call.name}")
    except WorldCrashed as e:
      raise EpisodeError(errors.WORLD_CRASH, f"during tool {call.name}: {e}") from e
    except MalformedResult as e:
      raise EpisodeError(errors.MALFORMED_RESULT, f"tool {call.name}: {e}") from e
    except EpisodeError as e:
      if e.outcome == errors.TOOL_TIMEOUT:
        events[errors.TOOL_TIMEOUT] += 1
      raise
    except ToolTimeout as e:
      events[errors.TOOL_TIMEOUT] += 1
      raise EpisodeError(errors.TOOL_TIMEOUT, f"tool {call.name}: {e}") from e
    if out.is_error:
      events[errors.TOOL_ERROR] += 1
    results.append(out.text)
  return results


def _append_observation(run: _Run, ids, results: list[str]) -> None:
  """The results as the next observation, with the context nudge when the context is nearly
  full; an observation that would fill the context ends the episode instead."""
  s, traj, fmt = run.s, run.traj, run.fmt
  obs = fmt.observation_ids(ids, results)
  left_next = s.max_context - len(traj) - len(obs)
  if (s.nudge and left_next <= s.nudge_fraction * s.max_context
      and not (s.nudge_once and run.nudges)):
    notice = NUDGE_TEXT.format(left=max(left_next, 0))
    results[-1] = results[-1].rstrip() + "\n\n" + notice
    obs = fmt.observation_ids(ids, results)
    run.nudges += 1
    run.events["nudge"] += 1
    run.res.meta["nudge_at_tokens"] = len(traj) + len(obs)
  if len(traj) + len(obs) >= s.max_context:
    # Ends here rather than after appending: the trajectory (trained, reward 0) must still
    # fit the context, and so the training row.
    raise EpisodeError(errors.CONTEXT_OVERFLOW,
                       f"tool output of {len(obs)} tokens leaves no room "
                       f"in the context ({len(traj)} of {s.max_context} used)")
  traj.append_context(obs)


def _grade(run: _Run, judge_sink: list | None) -> None:
  """The world's grade of the answer (judge criteria deferred into judge_sink when given)."""
  res, world, answer = run.res, run.world, run.answer
  pending: list = []

  def grade():
    if judge_sink is None:
      return world.grade(answer or "")
    with judge_lib.deferred(pending):
      return world.grade(answer or "")
  try:
    g = run.clock.guarded("grade", grade, run.s.grade_timeout_s, errors.HARNESS_BUG, "grading")
    res.reward, res.passed, res.grade_details = float(g.reward), bool(g.passed), g.details
    if judge_sink is not None:
      judge_sink.extend(pending)
  except EpisodeError as e:
    res.outcome, res.detail = e.outcome, e.detail
  except Exception as e:  # noqa: BLE001
    res.outcome, res.detail = errors.HARNESS_BUG, f"grading failed: {type(e).__name__}: {e}"


def _close_world(run: _Run) -> None:
  t0 = time.monotonic()
  try:
    # close() kills the world process; it also unblocks any abandoned tool call.
    reuse = run.res.outcome in errors.MODEL_OUTCOMES or run.res.outcome == errors.ENGINE_ERROR
    call_with_timeout(lambda: run.world.close(reuse=reuse), 10.0, "world close")
  except Exception:  # noqa: BLE001 - a world that will not close taints the process
    run.res.tainted = True
  run.clock.spent["close"] = time.monotonic() - t0


def _finish(run: _Run) -> EpisodeResult:
  """The result completed: the trajectory's arrays, the answer, events and timings."""
  res, traj, clock = run.res, run.traj, run.clock
  if traj is not None:
    res.tokens = list(traj.tokens)
    res.loss_mask = list(traj.loss_mask)
    res.rollout_logprobs = list(traj.logprobs)
    res.prompt_len = traj.prompt_len
  res.final_answer = run.answer or ""
  res.events = {k: v for k, v in run.events.items() if v}
  count_judge_errors(res)
  total = time.monotonic() - clock.start
  res.timing = dict(clock.spent, total=total)
  res.timing["harness"] = total - sum(clock.spent.values())
  return res
