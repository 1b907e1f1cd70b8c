"""Worlds served by external MCP servers (envs/harness/mcp_worlds.py) through the harness.

Tasks come from a JSONL task file (fixtures/mcp_git_tasks.jsonl). Real servers throughout: the
reference git server (mcp-server-git, started per working copy
over stdio), a streamable-HTTP server built with the `mcp` package (fixtures/http_notes_server.py)
and, for injected faults only, a stdio server that misbehaves on request
(fixtures/faulty_mcp_server.py). Policies are token-level scripted policies (their tool calls
are written as Qwen3.5 text, tokenized and parsed by the agent loop like a model's) and, in one
slow test, the tiny random model behind the JetStream rollout server through its token client.
"""
import dataclasses
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from configs import tiny_cpu
from envs.chat import ChatFormat
from envs.chat import load_tokenizer
from envs import tasks as tasks_lib
from envs.apps import gateway
from envs.harness import errors
from envs.harness import mcp_worlds
from envs.harness.collate import batch_metrics
from envs.harness.collate import collate
from envs.harness.episodes import task_episodes
from envs.harness.jetstream_client import jetstream_policy_factory
from envs.harness.oracle import OraclePolicy
from envs.harness.policy import Observation
from envs.harness.policy import Action
from envs.harness.policy import ScriptedPolicy
from envs.harness.pool import AgentPool
from envs.tasks import task_file

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
GIT_TASKS = os.path.join(FIXTURES, "mcp_git_tasks.jsonl")  # world_dir: mcp_git_world
NOTES_WORLD = os.path.join(FIXTURES, "mcp_notes_world")
FAULTY = os.path.join(FIXTURES, "faulty_mcp_server.py")
NOTES_SERVER = os.path.join(FIXTURES, "http_notes_server.py")
GIT_SERVER = os.path.join(os.path.dirname(sys.executable), "mcp-server-git")
# Agent processes fork from a server that keeps the environment it started with: the header
# variable must exist before the first pool of the session starts, as in a real run.
HEADERS_ENV = "MCP_WORLDS_TEST_HEADERS"
os.environ[HEADERS_ENV] = "X-World-Token: tok-123"
GIT_SETUP = ("cd files && git init -q -b main && git add -A && "
             "git -c user.name=World -c user.email=world@example.invalid "
             "commit -q -m 'Initial import of the ledger'")


class PlanPolicy(ScriptedPolicy):
  """Plays a fixed list of tool calls per task prompt, then answers with every tool result it
  read (so the answer shows the state the server reported, and grading checks that)."""

  def __init__(self, fmt, plans):
    super().__init__(fmt)
    self.plans = dict(plans)

  def act(self, obs):
    steps = self.plans[obs.task]
    i = len(obs.results)
    if i < len(steps):
      name, args = steps[i]
      return Action(reasoning=f"Step {i + 1}.", tool_calls=[{"name": name, "arguments": args}])
    return Action(reasoning="Done.", content="\n".join(t for ts in obs.results for t in ts))


def _task(tid, prompt, rubric, world_dir, input_files=None):
  return tasks_lib.Task(id=tid, split="eval", domain="mcp", world_id="", level=1, family="mcp",
                        prompt=prompt, input_files=dict(input_files or {}), rubric=tuple(rubric),
                        oracle_steps=(), oracle_answer="", world_dir=world_dir)


def _config(source, tool_timeout_s=20.0):
  c = tiny_cpu.get_config()
  c.envs.source = source
  c.train.max_context = 16384
  c.harness.max_tokens_per_turn = 512
  c.harness.max_turns = 6
  c.harness.tool_timeout_s = tool_timeout_s
  c.harness.episode_timeout_s = 240.0
  c.harness.world_start_timeout_s = 120.0
  c.envs.gateway_start_timeout_s = 100.0
  return c


def _run(c, tasks, plans, work_root, workers=1):
  eps = task_episodes(tasks, c, work_root=str(work_root))
  with AgentPool.from_config(c, functools.partial(PlanPolicy, plans=plans), workers) as pool:
    return pool.run(eps)


# ---------------------------------------------------------------------------------------------
# mcp_stdio against the reference git server


def _git_tasks():
  """The git tasks of the JSONL fixture (read as a user's task file is) and each one's plan:
  its oracle's tool calls, played by PlanPolicy."""
  tasks = task_file.read_jsonl(GIT_TASKS)
  plans = {t.prompt: [(s["name"], s["args"]) for s in t.oracle_steps] for t in tasks}
  return [dataclasses.replace(t, oracle_steps=()) for t in tasks], plans


def _git_config():
  c = _config("mcp_stdio")
  c.envs.mcp.command = f"{GIT_SERVER} --repository {{world}}/files"
  c.envs.mcp.setup = GIT_SETUP
  return c


@pytest.mark.slow
def test_git_server_episodes_are_graded_and_do_not_see_each_others_writes(tmp_path):
  c = _git_config()
  tasks, plans = _git_tasks()
  results = _run(c, tasks, plans, tmp_path)
  by_id = {r.task_id: r for r in results}
  for r in results:
    assert r.outcome == errors.OK, (r.task_id, r.outcome, r.detail)
  # One process served the three episodes of the world, in order.
  assert len({r.worker_pid for r in results}) == 1
  # The branch episode wrote .git/HEAD and the refs; graded on the working copy.
  assert by_id["branch"].reward == 1.0 and by_id["branch"].passed
  assert "On branch release-2" in by_id["branch"].final_answer
  # The next episode of the same world sees the pristine repository plus its own input file.
  listing = by_id["branches"]
  assert listing.reward == 1.0, listing.grade_details
  assert "release-2" not in listing.final_answer
  # Answer criteria are graded for real: one of the two holds.
  assert by_id["log"].reward == 0.5 and not by_id["log"].passed
  assert [x["passed"] for x in by_id["log"].grade_details["criteria"]] == [True, False]
  # Tool calls went through the real server: turns = calls + the answer.
  assert [by_id[t.id].turns for t in tasks] == [len(plans[t.prompt]) + 1 for t in tasks]
  m = batch_metrics(results)
  assert m["outcome/ok"] == 3 and m["errors/tool_error"] == 0
  # The process's copies are released when its loop ends.
  assert not [n for n in os.listdir(tmp_path) if n.startswith("mcp-")]


def test_git_server_tool_list_and_errors_seen_through_the_world(tmp_path):
  c = _git_config()
  task = _git_tasks()[0][0]
  spec = mcp_worlds.world_spec(task, c, c.envs.worlds_root, str(tmp_path))
  world = spec.start()
  try:
    names = {t["function"]["name"] for t in world.tools()}
    assert {"git_status", "git_log", "git_create_branch", "git_checkout"} <= names
    status = world.call_tool("git_status", {"repo_path": "files"})
    assert not status.is_error and "On branch main" in status.text
    # The tool's own error is an error result the policy reads, not a crash.
    bad = world.call_tool("git_show", {"repo_path": "files", "revision": "no-such-ref"})
    assert bad.is_error and "no-such-ref" in bad.text
    # The setup ran in the working copy before the server started: it is a repository.
    assert os.path.isdir(os.path.join(world.dirs[1], "files", ".git"))
  finally:
    world.close(reuse=False)
  mcp_worlds.release_all()
  assert not [n for n in os.listdir(tmp_path) if n.startswith("mcp-")]


def test_tool_output_is_cut_client_side(tmp_path):
  c = _config("mcp_stdio")
  c.envs.tool_output_chars = 40
  c.envs.mcp.command = f"{sys.executable} {FAULTY}"
  s = gateway.ExternalServer(gateway.stdio_server([sys.executable, FAULTY], str(tmp_path)), c.envs)
  try:
    r = s.call_tool("echo", {"text": "x" * 100})
  finally:
    s.close()
  assert not r.is_error and r.text.startswith("x" * 40 + "\n") and "truncated 60" in r.text


def test_the_oracle_replays_an_external_servers_tools():
  """A task file's oracle may call tools that have no shell translation (the server's own)."""
  tasks, plans = _git_tasks()
  task = dataclasses.replace(tasks[0], oracle_steps=tuple(
      {"name": n, "args": a, "expect": ""} for n, a in plans[tasks[0].prompt]),
      oracle_answer="On release-2.")
  oracle = OraclePolicy(ChatFormat(load_tokenizer(), thinking=True), [task])
  act = oracle.act(Observation(task=task.prompt, results=[]))
  assert act.tool_calls == [{"name": "git_create_branch",
                             "arguments": {"repo_path": "files", "branch_name": "release-2"}}]
  oracle.style = "shell"
  with pytest.raises(ValueError, match="no shell translation"):
    oracle.act(Observation(task=task.prompt, results=[]))


# ---------------------------------------------------------------------------------------------
# the taxonomy, with injected faults


def test_faults_of_an_external_server_are_classified_and_the_loop_goes_on(tmp_path):
  c = _config("mcp_stdio", tool_timeout_s=2.5)
  c.envs.mcp.command = f"{sys.executable} {FAULTY}"
  kinds = ("crash", "hang", "bad_json", "bad_shape", "tool_error")
  tasks = [_task(k, f"Trigger the {k} fault.",
                 [dict(type="answer_text", text="after", description="echoed")], NOTES_WORLD)
           for k in kinds]
  tasks.append(_task("healthy", "Echo the word after.",
                     [dict(type="answer_text", text="after", description="echoed")], NOTES_WORLD))
  plans = {t.prompt: [("fault", {"mode": t.id}), ("echo", {"text": "after"})] for t in tasks[:-1]}
  plans[tasks[-1].prompt] = [("echo", {"text": "after"})]
  results = _run(c, tasks, plans, tmp_path)
  by_id = {r.task_id: r for r in results}
  assert by_id["crash"].outcome == errors.WORLD_CRASH, by_id["crash"].detail
  assert "Connection closed" in by_id["crash"].detail
  assert by_id["hang"].outcome == errors.TOOL_TIMEOUT, by_id["hang"].detail
  for k in ("bad_json", "bad_shape"):
    assert by_id[k].outcome == errors.MALFORMED_RESULT, (k, by_id[k].outcome, by_id[k].detail)
  assert "not valid JSON-RPC" in by_id["bad_json"].detail
  assert "not a valid MCP tool result" in by_id["bad_shape"].detail
  # A tool's own error result is read by the policy; the episode goes on and passes.
  te = by_id["tool_error"]
  assert te.outcome == errors.OK and te.events.get(errors.TOOL_ERROR) == 1 and te.passed
  assert by_id["healthy"].outcome == errors.OK and by_id["healthy"].passed
  m = batch_metrics(results)
  assert m["outcome/malformed_result"] == 2 and m["errors/malformed_result"] == 2
  # Infra failures mask their groups; the others train.
  mask = collate(results, c.harness.max_timeouts_per_group)["train_mask"]
  assert [bool(x) for x in mask] == [False, False, False, False, True, True]


def test_a_hanging_server_is_a_client_timeout_and_a_dead_one_a_crash(tmp_path):
  c = _config("mcp_stdio", tool_timeout_s=2.0)
  c.envs.mcp.command = f"{sys.executable} {FAULTY}"
  task = _task("t", "Trigger.", [dict(type="answer_text", text="x")], NOTES_WORLD)
  spec = mcp_worlds.world_spec(task, c, c.envs.worlds_root, str(tmp_path))
  world = spec.start()
  try:
    t0 = time.monotonic()
    with pytest.raises(errors.ToolTimeout, match="client_timeout"):
      world.call_tool("fault", {"mode": "hang"})
    assert time.monotonic() - t0 < 10
  finally:
    world.close(reuse=False)
  world = spec.start()
  try:
    with pytest.raises(errors.WorldCrashed, match="is gone"):
      world.call_tool("fault", {"mode": "crash"})
  finally:
    world.close(reuse=False)


def test_bad_settings_are_refused_with_the_key_named(tmp_path, monkeypatch):
  c = _config("mcp_stdio")
  task = _task("t", "x", [dict(type="answer_text", text="x")], NOTES_WORLD)
  with pytest.raises(ValueError, match="envs.mcp.command"):
    task_episodes([task], c)
  c.envs.source = "mcp_ftp"
  with pytest.raises(ValueError, match="envs.source"):
    task_episodes([task], c)
  c.envs.source = "mcp_http"
  with pytest.raises(ValueError, match="envs.mcp.url"):
    task_episodes([task], c)
  c.envs.mcp.url = "http://127.0.0.1:9/mcp"
  reads = _task("r", "x", [dict(type="file_contains", path="a", contains=[])], "")
  with pytest.raises(ValueError, match="file_contains"):
    task_episodes([reads], c)
  with pytest.raises(ValueError, match="not on PATH"):
    mcp_worlds.server_argv("no-such-mcp-server-binary {world}", "/w")
  assert mcp_worlds.server_argv(f"{sys.executable} -m x --dir '{{world}}/a b'", "/w 1") == [
      sys.executable, "-m", "x", "--dir", "/w 1/a b"]
  assert mcp_worlds.server_env("A=1, B={world}/x", "/w") == {"A": "1", "B": "/w/x"}
  with pytest.raises(ValueError, match="not K=V"):
    mcp_worlds.server_env("A", "/w")
  monkeypatch.setenv("MCP_TEST_HEADERS", "Authorization: Bearer s3cret\nX-Org: acme")
  assert mcp_worlds.request_headers("MCP_TEST_HEADERS") == {"Authorization": "Bearer s3cret",
                                                            "X-Org": "acme"}
  monkeypatch.setenv("MCP_TEST_HEADERS", "Bearer s3cret")
  with pytest.raises(ValueError, match="line 1") as e:
    mcp_worlds.request_headers("MCP_TEST_HEADERS")
  assert "s3cret" not in str(e.value)
  with pytest.raises(ValueError, match="not set"):
    mcp_worlds.request_headers("MCP_TEST_HEADERS_UNSET")


def test_a_failing_setup_or_start_is_a_world_crash_naming_it(tmp_path):
  c = _config("mcp_stdio")
  c.envs.mcp.command = f"{sys.executable} {FAULTY}"
  c.envs.mcp.setup = "echo setting up; echo broken >&2; exit 7"
  task = _task("t", "Echo.", [dict(type="answer_text", text="x")], NOTES_WORLD)
  (r,) = _run(c, [task], {task.prompt: [("echo", {"text": "x"})]}, tmp_path)
  assert r.outcome == errors.WORLD_CRASH
  assert "envs.mcp.setup failed (exit 7)" in r.detail and "broken" in r.detail
  # A server that exits at once: the crash report quotes the end of its log.
  c.envs.mcp.setup = ""
  c.envs.mcp.command = f"{sys.executable} no_such_server.py"
  (r,) = _run(c, [task], {task.prompt: [("echo", {"text": "x"})]}, tmp_path)
  assert r.outcome == errors.WORLD_CRASH and "did not start" in r.detail
  assert "no_such_server.py" in r.detail and "No such file" in r.detail, r.detail


# ---------------------------------------------------------------------------------------------
# mcp_http


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def notes_server(tmp_path):
  world = tmp_path / "notes"
  shutil.copytree(NOTES_WORLD, world)
  port = _free_port()
  log = open(tmp_path / "server.log", "w")
  proc = subprocess.Popen([sys.executable, NOTES_SERVER, "--world", str(world), "--port",
                           str(port), "--token", "tok-123"], stdout=log, stderr=subprocess.STDOUT)
  base = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 90
  while True:
    try:
      req = urllib.request.Request(base + "/resets", headers={"X-World-Token": "tok-123"})
      with urllib.request.urlopen(req, timeout=2):
        break
    except OSError:
      if proc.poll() is not None or time.monotonic() > deadline:
        proc.kill()
        raise RuntimeError(f"notes server did not come up: {open(tmp_path / 'server.log').read()}")
      time.sleep(0.3)
  yield base, str(world)
  proc.kill()
  proc.wait(10)
  log.close()


def _resets(base):
  req = urllib.request.Request(base + "/resets", headers={"X-World-Token": "tok-123"})
  with urllib.request.urlopen(req, timeout=5) as r:
    return json.loads(r.read())["resets"]


def test_http_server_episodes_reset_before_each_and_graded(notes_server, tmp_path):
  base, world = notes_server
  c = _config("mcp_http")
  c.envs.mcp.url = base + "/mcp"
  c.envs.mcp.reset = base + "/reset"
  c.envs.mcp.headers_env = HEADERS_ENV
  write = _task("write", "Write the word approved to decision.txt.",
                [dict(type="file_contains", path="decision.txt", contains=[{"text": "approved"}],
                      description="the note holds the decision"),
                 dict(type="unchanged", path="welcome.txt", description="welcome kept")], world)
  read = _task("read", "Read decision.txt, then welcome.txt.",
               [dict(type="answer_text", text="Team lunch moved to Friday")], "")
  plans = {write.prompt: [("write_note", {"name": "decision.txt", "text": "approved"})],
           read.prompt: [("read_note", {"name": "decision.txt"}),
                         ("read_note", {"name": "welcome.txt"})]}
  before = _resets(base)
  results = _run(c, [write, read], plans, tmp_path)
  w, r = results
  assert w.outcome == errors.OK and w.reward == 1.0 and w.passed, (w.detail, w.grade_details)
  # The reset hook ran before each episode: the second one no longer sees the first's note.
  assert _resets(base) == before + 2
  assert r.outcome == errors.OK and r.passed and r.events.get(errors.TOOL_ERROR) == 1
  assert "approved" not in r.final_answer
  assert not os.path.exists(os.path.join(world, "files", "decision.txt"))


def test_http_server_without_the_headers_is_a_world_crash(notes_server, tmp_path):
  base, _ = notes_server
  c = _config("mcp_http")
  c.envs.mcp.url = base + "/mcp"
  task = _task("t", "Read welcome.txt.", [dict(type="answer_text", text="Friday")], "")
  plans = {task.prompt: [("read_note", {"name": "welcome.txt"})]}
  (r,) = _run(c, [task], plans, tmp_path)
  assert r.outcome == errors.WORLD_CRASH, r.detail
  c.envs.mcp.headers_env = HEADERS_ENV
  marker = tmp_path / "reset ran"
  c.envs.mcp.reset = f"touch '{marker}'"  # the shell form of the reset hook
  (r,) = _run(c, [task], plans, tmp_path)
  assert r.outcome == errors.OK and r.passed, (r.outcome, r.detail)
  assert marker.exists()


# ---------------------------------------------------------------------------------------------
# generated source, a task in its own folder


def test_generated_source_serves_a_task_folder_with_the_projects_gateway(tmp_path):
  c = _config("generated")
  c.harness.style = "shell"
  task = _task("own", "What does welcome.txt say?",
               [dict(type="answer_text", text="Team lunch moved to Friday")], NOTES_WORLD)
  plans = {task.prompt: [("read", {"path": "files/welcome.txt"})]}
  (r,) = _run(c, [task], plans, tmp_path)
  assert r.outcome == errors.OK and r.passed, (r.outcome, r.detail, r.final_answer)


# ---------------------------------------------------------------------------------------------
# the policy served by the JetStream rollout server


@pytest.mark.slow
def test_model_episodes_through_the_rollout_server_against_the_git_server(tmp_path):
  """The token client against the JetStream rollout server (tiny random model) in git-server
  worlds: whatever the model writes, every episode ends classified and graded."""
  # Lazy: the rollout server's imports (JetStream, the engine) take seconds, for this test only.
  from rl.rollout import serve
  c = _git_config()
  c.rollout.slots = 4
  c.rollout.max_len = 4096
  c.rollout.prefill_buckets = (2048, 4096)
  c.train.max_context = 4096
  c.harness.max_tokens_per_turn = 32
  c.harness.max_turns = 3
  c.harness.model_timeout_s = 600.0   # the first calls compile
  c.harness.episode_timeout_s = 1200.0
  tasks, _ = _git_tasks()
  server = serve.build_server(c, port=0, warmup=False)
  try:
    c.rollout.address = server.address
    eps = task_episodes(tasks[:2], c, samples_per_task=2, work_root=str(tmp_path))
    with AgentPool.from_config(c, jetstream_policy_factory(c), 2) as pool:
      results = pool.run(eps)
  finally:
    server.stop()
  assert len(results) == 4
  n_criteria = {t.id: len(t.rubric) for t in tasks}
  for r in results:
    assert r.outcome in errors.MODEL_OUTCOMES, (r.outcome, r.detail)
    assert 0.0 <= r.reward <= 1.0 and len(r.grade_details["criteria"]) == n_criteria[r.task_id]
    sampled = [lp for lp, k in zip(r.rollout_logprobs, r.loss_mask) if k]
    assert sampled and all(lp <= 0 for lp in sampled)
  # The branch task's file criterion read the working copy, which a random model leaves on main.
  branch = [r for r in results if r.task_id == "branch"]
  assert all(not r.grade_details["criteria"][0]["passed"] for r in branch)
