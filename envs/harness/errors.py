"""The error taxonomy: every way an episode can go wrong has a name, a counter and a rule.

Each trajectory ends with exactly one *outcome*. `ok` is a final answer; the others are:

  class             who      terminal  what happened                                  training
  ----------------  -------  --------  ---------------------------------------------  -----------------
  context_overflow  model    yes       the next turn no longer fits in max_context     reward 0, trained
  max_turns         model    yes       max_turns assistant turns without an answer    graded, trained
  bad_tool_call     model    after N   malformed tool call after the repair budget    graded, trained
  unknown_tool      model    after N   call to a tool the world does not have, after  graded, trained
                                       the repair budget
  tool_timeout      infra    yes       a tool call did not return in tool_timeout_s    timeout rule
  episode_timeout   infra    yes       the episode ran past episode_timeout_s          timeout rule
  engine_error      infra    yes       the policy call failed, timed out, or returned  group masked
                                       malformed output
  world_crash       infra    yes       the world failed to start or its process died   group masked
  harness_bug       infra    yes       an unexpected exception in the harness, or the  group masked
                                       agent-loop process itself died
  malformed_result  infra    yes       the world's server answered a tool call with    group masked
                                       something that is not MCP: a line that is not
                                       JSON-RPC, or a result of the wrong shape (an
                                       external server's bug; the world is restarted)
  tool_error        world    no        a tool returned an error (bad path, exception   (event only)
                                       inside the tool); the text goes to the model

A judge criterion the judge could not decide (envs/judge.py: a malformed or failed reply after
its retries) is the event `judge_error`: the criterion counts as not met, the episode keeps its
outcome, and its grade details carry the count.

Model-side failures below their budget (a malformed or unknown call that got a repair
message, a tool error the model can react to) are *events*: counted per batch, never masking.

Group masking (docs/design.md, "Error taxonomy and group masking"): an infra error in a group masks the whole group; more
than `max_timeouts_per_group` timed-out trajectories mask the group, fewer mask only the
timed-out ones; context overflow trains with reward 0.
"""

OK = "ok"
CONTEXT_OVERFLOW = "context_overflow"
MAX_TURNS = "max_turns"
BAD_TOOL_CALL = "bad_tool_call"
UNKNOWN_TOOL = "unknown_tool"
TOOL_TIMEOUT = "tool_timeout"
EPISODE_TIMEOUT = "episode_timeout"
ENGINE_ERROR = "engine_error"
WORLD_CRASH = "world_crash"
HARNESS_BUG = "harness_bug"
TOOL_ERROR = "tool_error"
MALFORMED_RESULT = "malformed_result"
JUDGE_ERROR = "judge_error"

# The fixed list, in reporting order.
# (New classes go last: batches record outcomes as indices into OUTCOMES.)
ERROR_CLASSES = (TOOL_TIMEOUT, TOOL_ERROR, BAD_TOOL_CALL, UNKNOWN_TOOL, CONTEXT_OVERFLOW,
                 MAX_TURNS, ENGINE_ERROR, WORLD_CRASH, EPISODE_TIMEOUT, HARNESS_BUG,
                 MALFORMED_RESULT)
OUTCOMES = (OK,) + tuple(c for c in ERROR_CLASSES if c != TOOL_ERROR)
# Outcomes the model caused: the trajectory is valid training data.
MODEL_OUTCOMES = (OK, CONTEXT_OVERFLOW, MAX_TURNS, BAD_TOOL_CALL, UNKNOWN_TOOL)
TIMEOUTS = (TOOL_TIMEOUT, EPISODE_TIMEOUT)
# Infrastructure failures that say nothing about the policy: the group is masked.
GROUP_FATAL = (ENGINE_ERROR, WORLD_CRASH, HARNESS_BUG, MALFORMED_RESULT)
# Outcomes that are graded against the world (the others get reward 0 and no grading).
GRADED = (OK, MAX_TURNS, BAD_TOOL_CALL, UNKNOWN_TOOL)
# Events counted during an episode that do not end it.
# A tool timeout is also an event, so that errors/tool_timeout counts every one.
EVENTS = (TOOL_ERROR, TOOL_TIMEOUT, BAD_TOOL_CALL, UNKNOWN_TOOL, "repair", "nudge", JUDGE_ERROR)


class EpisodeError(Exception):
  """Ends an episode with a named outcome."""

  def __init__(self, outcome: str, detail: str = ""):
    if outcome not in OUTCOMES:
      raise ValueError(f"unknown outcome {outcome!r}")
    super().__init__(f"{outcome}: {detail}" if detail else outcome)
    self.outcome = outcome
    self.detail = detail


class WorldCrashed(Exception):
  """Raised by a world adapter when the world process is gone or its transport broke."""


class MalformedResult(Exception):
  """Raised by a world adapter when the server's answer to a tool call is not valid MCP."""


class ToolTimeout(Exception):
  """Raised by a world adapter when its own client gave up waiting for a tool."""


class CallTimeout(Exception):
  """A call guarded by `call_with_timeout` did not return in time."""
