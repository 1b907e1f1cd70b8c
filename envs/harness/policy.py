"""The policy interface the agent loop calls, and token-level scripted policies.

A policy is token-in/token-out: it receives the whole context as ids and returns the ids it
sampled, one logprob per sampled id, and why it stopped. The JetStream client in
rl/rollout/ implements it against the engine; scripted policies (the oracle, fault
injectors) implement it by writing Qwen3.5 text and tokenizing it, so that they exercise
exactly the path a model does.
"""
import dataclasses
from typing import Any, Protocol, Sequence

from envs.chat import template
from envs.chat.format import ChatFormat

FINISH_STOP = "stop"      # a stop id was sampled (it is the last of the returned ids)
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample; the engine's sampler reads these (seed None = engine's own)."""
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int | None = None


class Policy(Protocol):
  """Ids in, sampled ids + logprobs out."""

  def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int,
               stop_ids: Sequence[int]) -> tuple[list[int], list[float], str]:
    """Samples a continuation of `prompt_ids`.

    Args:
      prompt_ids: the whole context so far.
      sampling: sampling parameters.
      max_tokens: at most this many ids are returned.
      stop_ids: generation ends after any of these is sampled; it is returned as the last id.

    Returns:
      (ids, logprobs, finish_reason): the sampled ids, the logprob of each under the sampling
      distribution, and "stop" or "length".
    """
    ...


@dataclasses.dataclass
class Action:
  """One assistant turn a scripted policy writes: tool calls, or a final answer."""
  content: str = ""
  tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  reasoning: str = ""
  raw: str | None = None  # verbatim turn text (for malformed calls); overrides the rest


@dataclasses.dataclass
class Observation:
  """What a scripted policy reads back from its context ids."""
  task: str                        # the first user turn
  results: list[list[str]]         # tool results after each previous assistant turn


class ScriptedPolicy:
  """A token-level policy that writes text: subclasses implement `act`.

  It reads only its input ids (the task and the tool results in them), like a model would,
  renders its action with the chat template, tokenizes it and returns the ids with logprob 0
  (it is deterministic). Its output thus goes through the same parsing, TITO accounting and
  taxonomy as a model's.
  """

  def __init__(self, fmt: ChatFormat):
    self.fmt = fmt
    self.tok = fmt.tok
    self.sp = fmt.sp

  def act(self, obs: Observation) -> Action:
    raise NotImplementedError

  def read(self, prompt_ids: Sequence[int]) -> Observation:
    ids = list(prompt_ids)
    sp = self.sp
    starts = [i for i, t in enumerate(ids) if t == sp.im_start]
    task = ""
    results: list[list[str]] = []
    for n, s in enumerate(starts):
      end = starts[n + 1] if n + 1 < len(starts) else len(ids)
      turn = ids[s + 1:end]
      head = self.tok.decode(turn[:4])
      if head.startswith("user"):
        if sp.tool_response in turn:
          out, pos = [], 0
          while sp.tool_response in turn[pos:]:
            a = turn.index(sp.tool_response, pos)
            b = turn.index(sp.tool_response_end, a)
            out.append(self.tok.decode(turn[a + 1:b]).strip())
            pos = b + 1
          results.append(out)
        elif not task:
          body = turn[:turn.index(sp.im_end)] if sp.im_end in turn else turn
          task = self.tok.decode(body)[len("user\n"):].strip()
    return Observation(task=task, results=results)

  def generate(self, prompt_ids, sampling, max_tokens, stop_ids):
    del sampling
    action = self.act(self.read(prompt_ids))
    reasoning = action.reasoning if self.fmt.thinking else None
    text = action.raw if action.raw is not None else template.assistant_text(
        action.content, action.tool_calls, reasoning)
    ids = self.tok.encode(text) + [stop_ids[0]]
    finish = FINISH_STOP
    if len(ids) > max_tokens:
      ids, finish = ids[:max_tokens], FINISH_LENGTH
    return ids, [0.0] * len(ids), finish
