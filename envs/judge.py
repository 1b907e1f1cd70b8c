"""A judge model for natural-language rubric criteria (`{"type": "judge", "instruction": ...}`).

  j = judge.for_config(config.envs.judge)          # one per process and setting
  files = judge.world_changes(before_dir, after_dir, task.input_files, read_text)
  v = j.grade(task, criterion, final_answer, files)  # Verdict(met, reason, error)
  vs = j.grade_all(task, criteria, final_answer, files)   # concurrently, rubric order

The backend is any OpenAI-compatible chat-completions endpoint: `POST {endpoint}/chat/completions`
with the model `envs.judge.model`, or the first of `GET {endpoint}/models` when that is empty.
The API key is read from the environment variable named by `envs.judge.api_key_env` and sent as
a Bearer header only: it is kept out of logs, metrics, exceptions, cache keys and reprs.

The judge sees the task's prompt, the criterion, the agent's final answer, the task's expected
files (if any) and the files the episode changed or produced, as text, cut to
`max_file_chars` in total with a note of what was left out. It must end its answer with the
line `VERDICT: MET` or `VERDICT: NOT_MET` (`parse_verdict`); anything else is malformed and
asked again, like a failed or timed-out request, up to `retries` times; then the criterion's
verdict is a judge error (met=None), which graders count as not met, never as a pass.

Verdicts are cached by a content hash of (model, messages), in memory and, with `cache_dir`,
on disk. Requests are paced to `rate_per_s` and at most `max_concurrency` are in flight in a
process. Inside `deferred(sink)` graders submit their judge criteria and return at once
(envs/tasks/rubric.py); the agent-loop process sends the episode's result when the verdicts
arrive and meanwhile runs its next episode (envs/harness/pool.py).
"""
import collections
import concurrent.futures
import contextlib
import dataclasses
import difflib
import hashlib
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger(__name__)

JUDGE_ERROR = "judge_error"   # a criterion the judge could not decide: counted, graded not met
_VERDICT_RE = re.compile(r"^VERDICT: (MET|NOT_MET)$")
_THINK_RE = re.compile(r"<think>.*?</think>", re.S)
_MEMORY_CACHE_SIZE = 65536     # verdicts kept in memory per judge (oldest dropped first)

SYSTEM_PROMPT = (
    "You grade the work of an AI agent against one criterion. You are shown the task the agent "
    "was given, the criterion, the agent's final answer, possibly reference files of a correct "
    "solution, and the files the agent created, changed or deleted. Decide only whether this "
    "one criterion is met; judge by what the answer and the files actually contain.\n"
    "Reply with a short reason (at most three sentences), then end your reply with exactly one "
    "last line, nothing after it:\n"
    "VERDICT: MET\n"
    "or\n"
    "VERDICT: NOT_MET")


class JudgeUnavailable(RuntimeError):
  """Judge criteria with no judge configured (envs.judge.endpoint / envs.judge.checkpoint)."""


class MalformedVerdict(ValueError):
  """The judge's reply does not end with the strict verdict line."""


@dataclasses.dataclass(frozen=True)
class Verdict:
  """The judge's decision on one criterion.

  Attributes:
    met: True / False; None when the judge could not decide (a judge error).
    reason: the judge's reasoning (its reply before the verdict line).
    error: why there is no decision ("" when met is not None).
  """
  met: Optional[bool]
  reason: str = ""
  error: str = ""


def parse_verdict(text: Any) -> Verdict:
  """The verdict in a judge reply; raises MalformedVerdict unless it is well-formed.

  Well-formed: a string whose last non-empty line (after any <think> block) is exactly
  `VERDICT: MET` or `VERDICT: NOT_MET`, and no other line starts with `VERDICT`.
  """
  if not isinstance(text, str):
    raise MalformedVerdict(f"the reply content is {type(text).__name__}, not text")
  body = _THINK_RE.sub("", text)
  if "<think>" in body or "</think>" in body:
    body = body.rsplit("</think>", 1)[-1] if "</think>" in body else ""
  lines = [ln.strip() for ln in body.strip().splitlines() if ln.strip()]
  if not lines:
    raise MalformedVerdict("empty reply")
  m = _VERDICT_RE.match(lines[-1])
  if m is None:
    raise MalformedVerdict(f"the last line is {lines[-1][:80]!r}, not 'VERDICT: MET' or "
                           f"'VERDICT: NOT_MET'")
  if any(ln.upper().startswith("VERDICT") for ln in lines[:-1]):
    raise MalformedVerdict("more than one verdict line")
  return Verdict(met=m.group(1) == "MET", reason="\n".join(lines[:-1])[:1000])


# -- what the judge is shown ----------------------------------------------------------------

def _walk(root: str) -> dict:
  """{relative path: absolute path} of the regular files under `root` ({} when absent)."""
  out = {}
  if not root or not os.path.isdir(root):
    return out
  for d, _, names in os.walk(root):
    for n in names:
      p = os.path.join(d, n)
      if os.path.isfile(p) and not os.path.islink(p):
        out[os.path.relpath(p, root)] = p
  return out


def _same_bytes(a: str, b: str) -> bool:
  if os.path.getsize(a) != os.path.getsize(b):
    return False
  with open(a, "rb") as fa, open(b, "rb") as fb:
    return fa.read() == fb.read()


def _text_of(path: str, read_text: Callable[[str], str]) -> Optional[str]:
  """The text of a file (documents through `read_text`), or None for binary data."""
  try:
    text = read_text(path)
  except Exception as e:  # noqa: BLE001 - the agent may leave a document unreadable
    return f"[unreadable: {type(e).__name__}: {str(e)[:200]}]"
  return None if "\x00" in text else text


def world_changes(before_dir: str, after_dir: str, input_files: Optional[dict],
                  read_text: Callable[[str], str]) -> dict:
  """The files an episode created, changed or deleted, as text for the judge.

  Args:
    before_dir: the world as the episode started (the pristine world).
    after_dir: the world's working copy after the episode.
    input_files: {path under files/: text} the task placed in the world (not the agent's work
      unless it changed them).
    read_text: path -> text (documents as their text; see rubric._doc_text).
  Returns:
    {path relative to the world: text}: a new file's text, a changed file's unified diff of
    its text (before -> after), or a one-line note (deleted, binary).
  """
  before, after = _walk(before_dir), _walk(after_dir)
  given = {os.path.join("files", k.lstrip("/")): v for k, v in (input_files or {}).items()}
  out = {}
  for rel in sorted(set(before) | set(after)):
    if rel not in after:
      out[rel] = "[deleted]"
      continue
    pa = after[rel]
    if rel in before and _same_bytes(before[rel], pa):
      continue
    if rel not in before and rel in given:
      with open(pa, "rb") as f:
        if f.read() == str(given[rel]).encode("utf-8"):
          continue
    new = _text_of(pa, read_text)
    if new is None:
      out[rel] = f"[binary file, {os.path.getsize(pa)} bytes]"
      continue
    old = _text_of(before[rel], read_text) if rel in before else given.get(rel)
    if old is None:
      out[rel] = "[new file]\n" + new
    else:
      diff = difflib.unified_diff(str(old).splitlines(), new.splitlines(), "before", "after",
                                  lineterm="", n=2)
      out[rel] = "[changed; unified diff of its text]\n" + "\n".join(diff)
  return out


def render_files(sections: Sequence[tuple], max_chars: int) -> str:
  """Files as text under one budget, in order, with a note of what was cut.

  Args:
    sections: (heading, {path: text}) pairs, shown in order.
    max_chars: characters of file text shown in all (headings and notes not counted).
  """
  left = max(0, int(max_chars))
  parts, cut = [], []
  for heading, files in sections:
    if not files:
      continue
    parts.append(f"## {heading}")
    for path, text in files.items():
      text = str(text)
      if left <= 0:
        cut.append(f"{path} ({len(text)} characters, not shown)")
        continue
      shown = text[:left]
      left -= len(shown)
      parts.append(f"### {path}\n{shown}")
      if len(shown) < len(text):
        cut.append(f"{path} (cut after {len(shown)} of {len(text)} characters)")
  if cut:
    parts.append(f"[Files were cut to {int(max_chars)} characters in all: " + "; ".join(cut) + "]")
  return "\n\n".join(parts)


def build_messages(task, criterion: dict, final_answer: str, files: dict,
                   max_file_chars: int) -> list:
  """The chat messages of one judge request (system + user)."""
  instruction = criterion.get("instruction")
  if not isinstance(instruction, str) or not instruction.strip():
    raise ValueError(f"a judge criterion needs a non-empty 'instruction' string, got {criterion!r}")
  expected = dict(task.expected_files or {})
  gold = expected.pop("gold_response", None)   # a reference final answer, not a file
  shown = render_files([("Reference files of a correct solution", expected),
                        ("Files the agent created, changed or deleted", dict(files or {}))],
                       max_file_chars)
  reference = f"# A reference final answer (of a correct solution)\n{gold}\n\n" if gold else ""
  user = (f"# Task given to the agent\n{task.prompt}\n\n"
          f"# Criterion\n{instruction.strip()}\n\n"
          f"# The agent's final answer\n{final_answer or '(no final answer)'}\n\n"
          f"{reference}"
          f"# Files\n{shown or '(the agent changed no file)'}\n\n"
          "Is the criterion met? End with the line VERDICT: MET or VERDICT: NOT_MET.")
  return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


# -- the client -----------------------------------------------------------------------------

class _Pacer:
  """Spaces request starts at least 1/rate seconds apart (rate 0 = no pacing)."""

  def __init__(self, rate_per_s: float):
    self.interval = 1.0 / rate_per_s if rate_per_s > 0 else 0.0
    self._lock = threading.Lock()
    self._next = 0.0

  def wait(self) -> None:
    if not self.interval:
      return
    with self._lock:
      now = time.monotonic()
      slot = max(now, self._next)
      self._next = slot + self.interval
    if slot > now:
      time.sleep(slot - now)


class _RequestFailed(Exception):
  """One HTTP exchange failed (its text is free of the API key)."""


class Judge:
  """A chat-completions judge: strict verdicts, retries, a cache, pacing and a concurrency cap.

  Args:
    endpoint: OpenAI-compatible base URL (e.g. http://host:8000/v1).
    model: model name; "" = the first of GET {endpoint}/models.
    api_key_env: environment variable holding the API key ("" or unset = no Authorization).
    timeout_s: one request's socket timeout.
    retries: re-asks after a malformed verdict or a failed request.
    max_concurrency: requests in flight at once (and threads for `submit`).
    rate_per_s: request starts per second; 0 = unpaced.
    max_file_chars: file text shown to the judge, in all.
    max_tokens: completion budget of one verdict.
    cache_dir: directory of the on-disk verdict cache; "" = in memory only.
  """

  def __init__(self, endpoint: str, model: str = "", api_key_env: str = "",
               timeout_s: float = 60.0, retries: int = 2, max_concurrency: int = 4,
               rate_per_s: float = 0.0, max_file_chars: int = 8000, max_tokens: int = 256,
               cache_dir: str = ""):
    if not endpoint:
      raise JudgeUnavailable("judge criteria need config.envs.judge.endpoint (an OpenAI-"
                             "compatible base URL) or config.envs.judge.checkpoint (a model the "
                             "run serves itself)")
    if max_concurrency < 1:
      raise ValueError(f"envs.judge.max_concurrency must be >= 1, got {max_concurrency}")
    if retries < 0 or timeout_s <= 0 or rate_per_s < 0:
      raise ValueError(f"envs.judge: retries >= 0, timeout_s > 0 and rate_per_s >= 0 needed, got "
                       f"{retries}, {timeout_s}, {rate_per_s}")
    self.endpoint = endpoint.rstrip("/")
    self.model = model
    self.api_key_env = api_key_env
    self.timeout_s = float(timeout_s)
    self.retries = int(retries)
    self.max_concurrency = int(max_concurrency)
    self.max_file_chars = int(max_file_chars)
    self.max_tokens = int(max_tokens)
    self.cache_dir = cache_dir
    self._pacer = _Pacer(float(rate_per_s))
    self._slots = threading.BoundedSemaphore(self.max_concurrency)
    self._pool = concurrent.futures.ThreadPoolExecutor(self.max_concurrency,
                                                       thread_name_prefix="judge")
    self._lock = threading.Lock()
    self._memory: collections.OrderedDict = collections.OrderedDict()
    self._stats = collections.Counter()

  @classmethod
  def from_config(cls, judge_cfg) -> "Judge":
    """From the `envs.judge` section (a ConfigDict or a plain dict)."""
    g = dict(judge_cfg)
    return cls(g["endpoint"], g["model"], g["api_key_env"], g["timeout_s"], g["retries"],
               g["max_concurrency"], g["rate_per_s"], g["max_file_chars"], g["max_tokens"],
               g["cache_dir"])

  def __repr__(self) -> str:
    return (f"Judge(endpoint={self.endpoint!r}, model={self.model or '(first listed)'!r}, "
            f"api_key_env={self.api_key_env!r})")

  @property
  def stats(self) -> dict:
    """Counts: requests, cache_hits, cache_misses, retries, malformed, failed_requests, verdicts,
    judge_errors."""
    with self._lock:
      return {k: int(self._stats.get(k, 0)) for k in (
          "requests", "cache_hits", "cache_misses", "retries", "malformed", "failed_requests",
          "verdicts", "judge_errors")}

  def _count(self, key: str, n: int = 1) -> None:
    with self._lock:
      self._stats[key] += n

  # -- HTTP -------------------------------------------------------------------------------

  def _key(self) -> str:
    return os.environ.get(self.api_key_env, "") if self.api_key_env else ""

  def _clean(self, text: str) -> str:
    key = self._key()
    return text.replace(key, "[api key]") if key else text

  def _http(self, method: str, path: str, body: Optional[dict] = None) -> dict:
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
      data = json.dumps(body).encode("utf-8")
      headers["Content-Type"] = "application/json"
    key = self._key()
    if key:
      headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(self.endpoint + path, data=data, method=method, headers=headers)
    try:
      with self._slots:
        self._pacer.wait()  # inside the slot: a paced start is a start, not a wait for a slot
        self._count("requests")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
          raw = r.read()
    except urllib.error.HTTPError as e:
      detail = e.read(300).decode("utf-8", "replace") if e.fp is not None else ""
      raise _RequestFailed(self._clean(f"HTTP {e.code} from {method} {path}: {detail}")) from None
    except (urllib.error.URLError, OSError, ValueError) as e:  # refused, timeout, bad URL
      reason = getattr(e, "reason", e)
      raise _RequestFailed(self._clean(f"{method} {path} failed: {type(e).__name__}: "
                                       f"{reason}")) from None
    try:
      return json.loads(raw)
    except ValueError:
      raise _RequestFailed(f"{method} {path} returned no JSON: {raw[:200]!r}") from None

  def _model_name(self) -> str:
    if not self.model:
      out = self._http("GET", "/models")
      try:
        name = out["data"][0]["id"]
      except (KeyError, IndexError, TypeError):
        raise _RequestFailed(f"GET /models lists no model: {str(out)[:200]}") from None
      self.model = str(name)
    return self.model

  # -- cache ------------------------------------------------------------------------------

  @staticmethod
  def cache_key(model: str, messages: list) -> str:
    """Content hash of (model, messages)."""
    blob = json.dumps({"model": model, "messages": messages}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()

  def _cache_get(self, key: str) -> Optional[Verdict]:
    with self._lock:
      if key in self._memory:
        self._memory.move_to_end(key)
        return self._memory[key]
    if self.cache_dir:
      p = os.path.join(self.cache_dir, key[:2], key + ".json")
      try:
        with open(p, encoding="utf-8") as f:
          d = json.load(f)
        v = Verdict(met=bool(d["met"]), reason=str(d.get("reason", "")))
      except (OSError, ValueError, KeyError, TypeError):
        return None
      self._cache_put(key, v, disk=False)
      return v
    return None

  def _cache_put(self, key: str, v: Verdict, disk: bool = True) -> None:
    with self._lock:
      self._memory[key] = v
      while len(self._memory) > _MEMORY_CACHE_SIZE:
        self._memory.popitem(last=False)
    if disk and self.cache_dir:
      d = os.path.join(self.cache_dir, key[:2])
      tmp = os.path.join(d, f".{key}.{os.getpid()}.{threading.get_ident()}")
      try:
        os.makedirs(d, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
          json.dump({"met": v.met, "reason": v.reason}, f)
        os.replace(tmp, os.path.join(d, key + ".json"))
      except OSError as e:  # a cache that cannot be written costs calls, not verdicts
        log.warning("judge: verdict cache %s not written: %s", self.cache_dir, e)

  # -- grading ----------------------------------------------------------------------------

  def ask(self, messages: list) -> Verdict:
    """One verdict for prepared messages: cached, else asked up to 1 + retries times."""
    error, looked = "", False
    for attempt in range(self.retries + 1):
      if attempt:
        self._count("retries")
        time.sleep(min(0.1 * 2 ** attempt, 5.0))
      try:
        model = self._model_name()
        key = self.cache_key(model, messages)
        if not looked:
          looked = True
          hit = self._cache_get(key)
          self._count("cache_hits" if hit is not None else "cache_misses")
          if hit is not None:
            return hit
        out = self._http("POST", "/chat/completions", {
            "model": model, "messages": messages, "max_tokens": self.max_tokens,
            "temperature": 0.0, "stream": False})
        try:
          content = out["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
          raise MalformedVerdict(f"no choices[0].message.content in {str(out)[:200]}") from None
        v = parse_verdict(content)
      except MalformedVerdict as e:
        self._count("malformed")
        error = f"malformed verdict: {self._clean(str(e))}"
      except _RequestFailed as e:
        self._count("failed_requests")
        error = f"request failed: {e}"
      else:
        self._count("verdicts")
        v = dataclasses.replace(v, reason=self._clean(v.reason))
        self._cache_put(key, v)
        return v
      log.warning("judge: %s (attempt %d of %d)", error, attempt + 1, self.retries + 1)
    self._count("judge_errors")
    return Verdict(met=None, error=f"{JUDGE_ERROR}: {error} (after {self.retries + 1} attempts)")

  def grade(self, task, criterion: dict, final_answer: str, files: dict) -> Verdict:
    """Whether `criterion` holds for the episode; never raises for the judge's failures.

    Args:
      task: the envs.tasks.Task (its prompt and expected_files are shown).
      criterion: {"type": "judge", "instruction": ...}.
      final_answer: the agent's final message.
      files: {path: text} the episode created, changed or deleted (`world_changes`).
    """
    return self.ask(build_messages(task, criterion, final_answer, files, self.max_file_chars))

  def submit(self, task, criterion: dict, final_answer: str, files: dict
             ) -> concurrent.futures.Future:
    """`grade` on the judge's threads; a Future of the Verdict."""
    messages = build_messages(task, criterion, final_answer, files, self.max_file_chars)
    return self._pool.submit(self.ask, messages)

  def grade_all(self, task, criteria: Sequence[dict], final_answer: str, files: dict) -> list:
    """Verdicts of several criteria of one episode, asked concurrently, in the given order."""
    futures = [self.submit(task, c, final_answer, files) for c in criteria]
    return [f.result() for f in futures]


_JUDGES: dict = {}
_JUDGES_LOCK = threading.Lock()


def for_config(judge_cfg) -> Judge:
  """The process's judge for this `envs.judge` setting (shared, so the concurrency cap, the
  pacing and the cache hold across everything this process grades)."""
  g = dict(judge_cfg)
  key = tuple(sorted((k, str(v)) for k, v in g.items()))
  with _JUDGES_LOCK:
    if key not in _JUDGES:
      _JUDGES[key] = Judge.from_config(g)
    return _JUDGES[key]


def require(tasks, judge_cfg) -> None:
  """Raises JudgeUnavailable when some task has judge criteria and no judge is configured
  (call it before any rollout)."""
  g = dict(judge_cfg)
  if g.get("endpoint"):
    return
  n = sum(any(c.get("type") == "judge" for c in t.rubric) for t in tasks)
  if n:
    hint = (" (envs.judge.checkpoint is set: serve it first, rl/judge_server.py)"
            if g.get("checkpoint") else "")
    raise JudgeUnavailable(f"{n} task(s) have judge criteria but config.envs.judge.endpoint is "
                           f"empty: set it to an OpenAI-compatible base URL, or set "
                           f"config.envs.judge.checkpoint to a Hugging Face Qwen3.5 folder the run "
                           f"serves as judge{hint}")


# -- deferred grading -----------------------------------------------------------------------

_LOCAL = threading.local()


@contextlib.contextmanager
def deferred(sink: list):
  """Within it (in this thread), graders submit judge criteria and return at once, appending a
  `Pending` to `sink`; the caller waits for it (envs/harness/pool.py)."""
  prev = getattr(_LOCAL, "sink", None)
  _LOCAL.sink = sink
  try:
    yield sink
  finally:
    _LOCAL.sink = prev


def deferring() -> Optional[list]:
  """The sink of the enclosing `deferred` block in this thread, or None (grade synchronously)."""
  return getattr(_LOCAL, "sink", None)


class Pending:
  """Judge verdicts of one graded episode still on their way.

  Args:
    futures: a Future of a Verdict per judge criterion.
    finish: [Verdict] -> the final grade update (a dict, see `result`).
  """

  def __init__(self, futures: Sequence[concurrent.futures.Future], finish: Callable):
    self.futures = list(futures)
    self._finish = finish
    self.t0 = time.monotonic()

  def done(self) -> bool:
    return all(f.done() for f in self.futures)

  def result(self) -> dict:
    """Waits for every verdict; returns {reward, passed, criteria: {rubric index: {description,
    passed, detail}}, judge_error: count}."""
    return self._finish([f.result() for f in self.futures])

  def when_done(self, fn: Callable[["Pending"], None]) -> None:
    """Calls fn(self) once, in whichever thread completes the last verdict."""
    left = [len(self.futures)]
    lock = threading.Lock()

    def one(_):
      with lock:
        left[0] -= 1
        last = left[0] == 0
      if last:
        fn(self)
    if not self.futures:
      fn(self)
    for f in self.futures:
      f.add_done_callback(one)
