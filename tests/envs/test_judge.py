"""The judge model for natural-language criteria (envs/judge.py), against a real HTTP server.

The server is http.server in a thread speaking the chat-completions protocol; each test gives it
a reply function (request body -> reply text, or an HTTP status) and reads back what it saw.
"""
import functools
import http.server
import json
import logging
import threading
import time

import pytest

from configs import base
from envs import judge as judge_lib
from envs.harness import errors
from tests.envs import harness_fakes
from envs.harness.agent_loop import LoopSettings
from envs.harness.collate import batch_metrics
from envs.harness.pool import AgentPool
from envs.harness.pool import FormatSpec
from envs.harness.world import Episode
from envs.tasks import rubric
from envs.tasks.task import Task

KEY_ENV = "JUDGE_TEST_API_KEY"
SECRET = "sk-test-7f3a9c-do-not-log"


class _Server:
  """A chat-completions server; `reply(body) -> str | int` (an int is an HTTP error status)."""

  def __init__(self, reply, delay_s: float = 0.0, models=("judge-model",)):
    self.reply, self.delay_s, self.models = reply, delay_s, models
    self.requests = []       # (path, headers dict, body dict, start, end)
    self.in_flight = self.max_in_flight = 0
    self._lock = threading.Lock()
    outer = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *a):
        pass

      def _send(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
          self.wfile.write(data)
        except OSError:
          pass  # the client gave up (timeout tests)

      def do_GET(self):
        outer._note(self.path, dict(self.headers), {}, time.monotonic())
        self._send(200, {"object": "list", "data": [{"id": m} for m in outer.models]})

      def do_POST(self):
        start = time.monotonic()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with outer._lock:
          outer.in_flight += 1
          outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
        try:
          time.sleep(outer.delay_s)
          out = outer.reply(body)
        finally:
          with outer._lock:
            outer.in_flight -= 1
        outer._note(self.path, dict(self.headers), body, start)
        if isinstance(out, int):
          # An error body that echoes the request's credentials, as a careless server might.
          self._send(out, {"error": {"message": f"bad request; auth was "
                                                f"{self.headers.get('Authorization')}"}})
          return
        self._send(200, {"id": "c1", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": out}}]})

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.httpd.daemon_threads = True
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

  def _note(self, path, headers, body, start):
    with self._lock:
      self.requests.append((path, headers, body, start, time.monotonic()))

  def posts(self):
    return [r for r in self.requests if r[0].endswith("/chat/completions")]

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.fixture
def serve():
  servers = []

  def make(reply, **kw):
    servers.append(_Server(reply, **kw))
    return servers[-1]
  yield make
  for s in servers:
    s.close()


def _judge_cfg(url, **kw):
  g = base.get_config().envs.judge
  g.endpoint = url
  g.api_key_env = KEY_ENV
  g.timeout_s = 5.0
  g.retries = 2
  g.update(kw)
  return g


def _envs_cfg(url, **kw):
  c = base.get_config().envs
  c.judge = _judge_cfg(url, **kw)
  return c


def _task(rubric_list, weights=(), expected_files=None, prompt="Write to the client."):
  return Task(id="t0", split="eval", domain="d", world_id="w", level=1, family="f",
              prompt=prompt, input_files={}, rubric=tuple(rubric_list), oracle_steps=(),
              oracle_answer="", expected_files=dict(expected_files or {}), weights=tuple(weights))


def _crit(text):
  return {"type": "judge", "instruction": text, "description": text}


def _by_instruction(body):
  """MET when the criterion mentions 'polite', else NOT_MET."""
  user = body["messages"][-1]["content"]
  crit = user.split("# Criterion\n", 1)[1].split("\n", 1)[0]
  return "The answer reads fine.\nVERDICT: " + ("MET" if "polite" in crit else "NOT_MET")


def test_met_and_not_met_verdicts_are_parsed(serve):
  s = serve(_by_instruction)
  j = judge_lib.Judge.from_config(_judge_cfg(s.url))
  task = _task([_crit("The reply is polite."), _crit("The reply quotes a figure.")])
  met = j.grade(task, task.rubric[0], "Dear client, thank you.", {})
  not_met = j.grade(task, task.rubric[1], "Dear client, thank you.", {})
  assert (met.met, met.error) == (True, "") and met.reason == "The answer reads fine."
  assert (not_met.met, not_met.error) == (False, "")
  # The model was found through GET /models and named in each request.
  assert [r[0] for r in s.requests if r[0].endswith("/models")] == ["/v1/models"]
  assert {p[2]["model"] for p in s.posts()} == {"judge-model"}


@pytest.mark.parametrize("text", [
    "Looks good.\nVERDICT: met", "VERDICT: MET.", "Sure.", "", "VERDICT: MET\nthanks",
    "VERDICT: NOT_MET\nVERDICT: MET", "VERDICT: YES", None])
def test_malformed_verdicts_are_rejected(text):
  with pytest.raises(judge_lib.MalformedVerdict):
    judge_lib.parse_verdict(text)


def test_strict_verdict_line_after_a_think_block_is_read():
  v = judge_lib.parse_verdict("<think>VERDICT: NOT_MET?</think>\nIt holds.\n VERDICT: MET \n")
  assert v.met is True and v.reason == "It holds."


def test_malformed_replies_are_retried_then_judge_error_never_a_pass(serve):
  s = serve(lambda body: "I believe the criterion is met.")
  j = judge_lib.Judge.from_config(_judge_cfg(s.url, retries=2))
  task = _task([_crit("The reply is polite.")])
  v = j.grade(task, task.rubric[0], "hi", {})
  assert v.met is None and v.error.startswith(errors.JUDGE_ERROR) and "malformed" in v.error
  assert len(s.posts()) == 3 and j.stats["malformed"] == 3 and j.stats["judge_errors"] == 1
  g = rubric.grade(task, "hi", "", "", _envs_cfg(s.url, retries=2))
  assert not g.passed and g.reward == 0.0
  assert g.results[0].detail.startswith(errors.JUDGE_ERROR) and rubric.judge_errors(g.results) == 1


def test_a_malformed_reply_then_a_good_one_gives_the_verdict(serve):
  replies = iter(["no verdict here", "Fine.\nVERDICT: MET"])
  s = serve(lambda body: next(replies))
  j = judge_lib.Judge.from_config(_judge_cfg(s.url, retries=1))
  task = _task([_crit("The reply is polite.")])
  assert j.grade(task, task.rubric[0], "hi", {}).met is True
  assert len(s.posts()) == 2 and j.stats["retries"] == 1


def test_timeouts_are_retried_then_judge_error(serve):
  s = serve(lambda body: "VERDICT: MET", delay_s=1.5)
  j = judge_lib.Judge.from_config(_judge_cfg(s.url, timeout_s=0.3, retries=1))
  task = _task([_crit("The reply is polite.")])
  t0 = time.monotonic()
  v = j.grade(task, task.rubric[0], "hi", {})
  assert v.met is None and v.error.startswith(errors.JUDGE_ERROR) and "timed out" in v.error
  assert j.stats["failed_requests"] == 2 and time.monotonic() - t0 < 1.5 * 2


def test_server_errors_and_refused_connections_are_judge_errors(serve):
  s = serve(lambda body: 500)
  j = judge_lib.Judge.from_config(_judge_cfg(s.url, retries=1))
  task = _task([_crit("The reply is polite.")])
  v = j.grade(task, task.rubric[0], "hi", {})
  assert v.met is None and "HTTP 500" in v.error and len(s.posts()) == 2
  s.close()
  gone = judge_lib.Judge.from_config(_judge_cfg(s.url, retries=0, model="m"))
  v = gone.grade(task, task.rubric[0], "hi", {})
  assert v.met is None and "request failed" in v.error


def test_the_same_request_twice_is_one_http_call(serve, tmp_path):
  s = serve(_by_instruction)
  cfg = _judge_cfg(s.url, cache_dir=str(tmp_path / "cache"))
  j = judge_lib.Judge.from_config(cfg)
  task = _task([_crit("The reply is polite.")])
  a = j.grade(task, task.rubric[0], "Dear client", {})
  b = j.grade(task, task.rubric[0], "Dear client", {})
  assert a == b and len(s.posts()) == 1
  assert (j.stats["cache_hits"], j.stats["cache_misses"]) == (1, 1)
  j.grade(task, task.rubric[0], "Another answer", {})           # other content: a new call
  assert len(s.posts()) == 2 and j.stats["cache_misses"] == 2
  # On disk: a new process's judge (a fresh instance) reads the verdict without a call.
  fresh = judge_lib.Judge.from_config(cfg)
  assert fresh.grade(task, task.rubric[0], "Dear client", {}) == a
  assert len(s.posts()) == 2 and fresh.stats["cache_hits"] == 1


def test_errors_are_not_cached(serve):
  replies = iter(["garbage", "Ok.\nVERDICT: NOT_MET"])
  s = serve(lambda body: next(replies))
  j = judge_lib.Judge.from_config(_judge_cfg(s.url, retries=0))
  task = _task([_crit("The reply is polite.")])
  assert j.grade(task, task.rubric[0], "hi", {}).met is None
  assert j.grade(task, task.rubric[0], "hi", {}).met is False and len(s.posts()) == 2


def test_api_key_reaches_the_server_and_nothing_else(serve, monkeypatch, caplog, capsys,
                                                     tmp_path):
  monkeypatch.setenv(KEY_ENV, SECRET)
  caplog.set_level(logging.DEBUG)
  calls = iter([500, "garbage", "Fine.\nVERDICT: MET"] + ["Fine.\nVERDICT: MET"] * 10)
  s = serve(lambda body: next(calls))
  cfg = _judge_cfg(s.url, retries=2, cache_dir=str(tmp_path / "cache"))
  j = judge_lib.Judge.from_config(cfg)
  task = _task([_crit("The reply is polite."), _crit("The reply is polite, twice.")])
  failed = judge_lib.Judge.from_config(_judge_cfg(s.url, retries=0))
  bad = failed.grade(task, task.rubric[0], "another", {})   # the 500 echoing the header
  v = j.grade(task, task.rubric[0], "hi", {})
  g = rubric.grade(task, "hi", "", "", _envs_cfg(s.url, retries=2,
                                                 cache_dir=str(tmp_path / "cache")))
  assert v.met is True and g.passed
  assert all(r[1].get("Authorization") == f"Bearer {SECRET}" for r in s.requests)
  out = capsys.readouterr()
  on_disk = "".join(p.name + p.read_text() for p in (tmp_path / "cache").rglob("*.json"))
  seen = [caplog.text, out.out, out.err, repr(j), str(j.stats), str(bad), str(v), str(g),
          on_disk, json.dumps(batch_metrics([]))]
  assert "HTTP 500" in bad.error and "[api key]" in bad.error   # the echoed key was cut out
  assert caplog.text and all(SECRET not in t for t in seen)
  assert SECRET not in judge_lib.Judge.cache_key("m", [{"role": "user", "content": "x"}])


def test_no_key_in_the_environment_sends_no_authorization(serve, monkeypatch):
  monkeypatch.delenv(KEY_ENV, raising=False)
  s = serve(_by_instruction)
  j = judge_lib.Judge.from_config(_judge_cfg(s.url))
  task = _task([_crit("The reply is polite.")])
  assert j.grade(task, task.rubric[0], "hi", {}).met is True
  assert all("Authorization" not in r[1] for r in s.requests)


def test_rate_limit_spaces_request_starts(serve):
  s = serve(_by_instruction)
  rate = 8.0
  j = judge_lib.Judge.from_config(_judge_cfg(s.url, rate_per_s=rate, model="m",
                                             max_concurrency=4))
  task = _task([_crit(f"The reply is polite ({k}).") for k in range(5)])
  t0 = time.monotonic()
  vs = j.grade_all(task, task.rubric, "hi", {})
  took = time.monotonic() - t0
  assert [v.met for v in vs] == [True] * 5
  starts = sorted(r[3] for r in s.posts())
  # 5 starts at least 1/rate apart: >= 4/rate seconds; the server sees them spaced too.
  assert took >= 4 / rate - 0.01
  assert starts[-1] - starts[0] >= 4 / rate - 0.05


def test_weighted_reward_and_pass_needs_every_criterion(serve):
  s = serve(_by_instruction)
  cfg = _envs_cfg(s.url)
  crits = [dict(type="answer_text", text="thank you"), _crit("The reply quotes a figure.")]
  g = rubric.grade(_task(crits, weights=(3, 1)), "Thank you!", "", "", cfg)
  assert [r.passed for r in g.results] == [True, False]
  assert g.reward == pytest.approx(0.75) and not g.passed
  g = rubric.grade(_task(crits), "Thank you!", "", "", cfg)          # equal weights
  assert g.reward == pytest.approx(0.5) and not g.passed
  crits[1] = _crit("The reply is polite.")
  g = rubric.grade(_task(crits, weights=(3, 1)), "Thank you!", "", "", cfg)
  assert g.reward == 1.0 and g.passed
  with pytest.raises(ValueError, match="weights"):
    rubric.grade(_task(crits, weights=(1,)), "Thank you!", "", "", cfg)


def test_grading_a_batch_overlaps_requests_up_to_max_concurrency(serve):
  s = serve(_by_instruction, delay_s=0.4)
  task = _task([_crit(f"The reply is polite ({k}).") for k in range(8)])
  j = judge_lib.Judge.from_config(_judge_cfg(s.url, model="m", max_concurrency=4))
  t0 = time.monotonic()
  assert [v.met for v in j.grade_all(task, task.rubric, "hi", {})] == [True] * 8
  took = time.monotonic() - t0
  assert s.max_in_flight == 4 and took < 8 * 0.4
  s2 = serve(_by_instruction, delay_s=0.2)
  two = judge_lib.Judge.from_config(_judge_cfg(s2.url, model="m", max_concurrency=2))
  two.grade_all(task, task.rubric, "hi", {})
  assert s2.max_in_flight == 2


def test_judge_sees_prompt_criterion_answer_expected_and_changed_files(serve, tmp_path):
  s = serve(_by_instruction)
  before, after = tmp_path / "before", tmp_path / "after"
  for d in (before, after):
    (d / "files").mkdir(parents=True)
    (d / "files" / "same.txt").write_text("unchanged text")
  (before / "files" / "memo.txt").write_text("line one\nline two\n")
  (after / "files" / "memo.txt").write_text("line one\nline 2 EDITED\n")
  (before / "files" / "gone.txt").write_text("bye")
  (after / "files" / "new.txt").write_text("NEW CONTENT " + "x" * 300)
  (after / "files" / "given.txt").write_text("input text")          # the task's input file
  task = Task(id="t", split="eval", domain="d", world_id="w", level=1, family="f",
              prompt="Edit the memo.", input_files={"given.txt": "input text"},
              rubric=(_crit("The memo is polite."),), oracle_steps=(), oracle_answer="",
              expected_files={"files/memo.txt": "REFERENCE MEMO",
                              "gold_response": "GOLD ANSWER"})
  g = rubric.grade(task, "Done, memo edited.", str(before), str(after),
                   _envs_cfg(s.url, max_file_chars=200))
  assert g.passed
  user = s.posts()[0][2]["messages"][-1]["content"]
  for part in ("Edit the memo.", "The memo is polite.", "Done, memo edited.", "REFERENCE MEMO",
               "+line 2 EDITED", "-line two", "files/gone.txt", "[deleted]", "NEW CONTENT"):
    assert part in user, part
  assert "unchanged text" not in user and "given.txt" not in user
  assert "# A reference final answer (of a correct solution)\nGOLD ANSWER" in user
  assert "cut to 200 characters" in user and "files/new.txt (cut after" in user


def test_office_files_are_shown_as_text(tmp_path):
  import openpyxl  # the document libraries are optional at import time in the rubric
  before, after = tmp_path / "b", tmp_path / "a"
  (before / "files").mkdir(parents=True)
  (after / "files").mkdir(parents=True)
  wb = openpyxl.Workbook()
  wb.active.title = "Q1"
  wb.active["A1"], wb.active["B1"] = "revenue", 1234.5
  wb.save(after / "files" / "book.xlsx")
  files = judge_lib.world_changes(str(before), str(after), {}, rubric.judge_text)
  assert files == {"files/book.xlsx": "[new file]\n[sheet Q1]\nrevenue\t1234.5"}


def test_no_endpoint_fails_fast_naming_the_settings():
  task = _task([_crit("The reply is polite.")])
  cfg = base.get_config().envs
  with pytest.raises(judge_lib.JudgeUnavailable,
                     match=r"envs\.judge\.endpoint.*envs\.judge\.checkpoint"):
    judge_lib.require([task], cfg.judge)
  judge_lib.require([_task([dict(type="answer_text", text="x")])], cfg.judge)  # no judge: fine
  with pytest.raises(rubric.JudgeUnavailable, match="envs.judge.endpoint"):
    rubric.grade(task, "hi", "", "", cfg)


def test_deferred_grading_returns_at_once_and_completes_later(serve):
  s = serve(_by_instruction, delay_s=0.5)
  task = _task([dict(type="answer_text", text="thank"), _crit("The reply is polite.")])
  sink = []
  t0 = time.monotonic()
  with judge_lib.deferred(sink):
    g = rubric.grade(task, "thank you", "", "", _envs_cfg(s.url, model="m"))
  assert time.monotonic() - t0 < 0.5 and len(sink) == 1
  assert g.reward == 0.5 and not g.passed and g.results[1].detail == "judge pending"
  update = sink[0].result()
  assert update["reward"] == 1.0 and update["passed"] and update["judge_error"] == 0
  assert update["criteria"][1]["passed"] and list(update["criteria"]) == [1]
  assert judge_lib.deferring() is None


# -- through the agent pool -----------------------------------------------------------------

SETTINGS = LoopSettings(
    max_turns=4, max_context=3000, max_tokens_per_turn=200, repair_attempts=1, nudge=False,
    nudge_fraction=0.2, nudge_once=True, world_start_timeout_s=10.0, model_timeout_s=10.0,
    tool_timeout_s=5.0, grade_timeout_s=10.0, episode_timeout_s=30.0, temperature=1.0, top_p=1.0,
    top_k=0)
FACTS = (("alpha", "412.5"),)


def _judged_world(url, rubric_list, **judge_kw):
  task = _task(rubric_list, prompt=harness_fakes.lookup_task("alpha"))
  return harness_fakes.JudgedWorldSpec(facts=FACTS, task_json=task.to_json(),
                                 envs_json=json.dumps(_envs_cfg(url, **judge_kw).to_dict()))


def _eps(worlds):
  return [Episode(task_id=f"t{i}", prompt=harness_fakes.lookup_task("alpha"), world=w, group_id=i)
          for i, w in enumerate(worlds)]


def test_pool_runs_next_episodes_while_verdicts_are_pending(serve):
  """One agent process, three judged episodes whose verdicts take 3 s each: the judge requests
  overlap, so the process did not wait for a verdict before its next episode."""
  s = serve(_by_instruction, delay_s=3.0)
  world = _judged_world(s.url, [dict(type="answer_text", text="412.5"),
                                _crit("The reply is polite.")], model="m")
  plain = harness_fakes.FakeWorldSpec(facts=FACTS, answer="412.5")
  eps = _eps([world, plain, world, world])
  seen = []
  with AgentPool(1, FormatSpec(), functools.partial(harness_fakes.LookupOracle), SETTINGS,
                 kill_grace_s=2.0) as pool:
    results = pool.run(eps, on_result=lambda r: seen.append(r.task_id))
  assert [r.task_id for r in results] == ["t0", "t1", "t2", "t3"]
  assert all(r.outcome == errors.OK and r.passed and r.reward == 1.0 for r in results)
  assert s.max_in_flight >= 2 and len(s.posts()) == 3
  assert seen[0] == "t1"                     # the plain episode came back before any verdict
  judged = [results[i] for i in (0, 2, 3)]
  assert all(r.grade_details["criteria"][1]["passed"] for r in judged)
  assert all(r.timing["judge"] >= 3.0 for r in judged) and "judge" not in results[1].timing
  assert results[1].grade_details == {"expected": "412.5"}


def test_pool_judge_errors_fail_the_criterion_and_are_counted(serve):
  s = serve(lambda body: "no verdict line")
  world = _judged_world(s.url, [dict(type="answer_text", text="412.5"),
                                _crit("The reply is polite.")], model="m", retries=1)
  with AgentPool(1, FormatSpec(), functools.partial(harness_fakes.LookupOracle), SETTINGS,
                 kill_grace_s=2.0) as pool:
    results = pool.run(_eps([world, world]))
  for r in results:
    assert r.outcome == errors.OK and not r.passed and r.reward == 0.5
    assert r.grade_details["judge_error"] == 1 and r.events[errors.JUDGE_ERROR] == 1
    assert r.grade_details["criteria"][1]["detail"].startswith(errors.JUDGE_ERROR)
  m = batch_metrics(results)
  assert m[f"errors/{errors.JUDGE_ERROR}"] == 2 and m[f"event/{errors.JUDGE_ERROR}"] == 2
  assert m["outcome/ok"] == 2 and m["pass_rate"] == 0.0



def test_an_unwritable_cache_dir_costs_calls_not_verdicts(serve, tmp_path):
  s = serve(_by_instruction)
  blocker = tmp_path / "not_a_dir"
  blocker.write_text("a file where the cache folder should be")
  j = judge_lib.Judge.from_config(_judge_cfg(s.url, cache_dir=str(blocker / "cache")))
  task = _task([_crit("The reply is polite.")])
  assert j.grade(task, task.rubric[0], "hi", {}).met is True
  assert j.grade(task, task.rubric[0], "hi", {}).met is True   # from memory
  assert len(s.posts()) == 1
