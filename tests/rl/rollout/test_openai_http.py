"""The rollout server's OpenAI-compatible HTTP front, spoken to by the `openai` client.

One server for the module: the shipped tiny base (assets/tiny_base, the weights configs/tiny_cpu.py
starts from) behind the gRPC port and the HTTP front, 4 slots, prompts in the 32 or 1024 bucket.
The tiny base calls a tool on level-1 tasks, so the chat test's tool call is the model's own,
read back by the harness's parser; the same request over gRPC must give the same ids.
"""
import concurrent.futures
import ctypes
import http.client
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import grpc as grpc_lib  # `grpc` is the module's TokenClient fixture
import openai
import pytest

from configs import tiny_cpu
from envs import tasks
from envs.apps import gateway
from envs.chat import ChatFormat
from envs.chat import load_tokenizer
from envs.harness import tool_subset
from envs.harness.jetstream_client import TokenClient
from envs.harness.policy import SamplingParams
from rl import params_io
from rl.rollout import openai_http
from rl.rollout import serve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SLOTS = 4
PROMPT = [301, 45, 77, 512, 19, 260, 88, 140, 9, 731, 33, 402]   # ordinary ids of the tiny vocab


@pytest.fixture(scope="module")
def config():
  c = tiny_cpu.get_config()
  c.unlock()
  c.rollout.slots = SLOTS
  c.rollout.max_len = 1280
  c.rollout.prefill_buckets = (32, 1024)
  c.rollout.prefix_cache = False
  return c


@pytest.fixture(scope="module")
def servers(config):
  server = serve.build_server(config, params=params_io.init_params(config), port=0, warmup=False)
  server.engine.warmup(buckets=(32,))
  front = serve.start_http(server, config, port=0)
  yield server, front
  front.stop()
  server.stop()


@pytest.fixture(scope="module")
def grpc(servers):
  c = TokenClient(servers[0].address, timeout_s=300)
  yield c
  c.close()


@pytest.fixture(scope="module")
def api(servers):
  return openai.OpenAI(base_url=servers[1].url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def fmt(config):
  return ChatFormat(load_tokenizer(config.tokenizer.path, config.tokenizer.special_ids),
                    config.tokenizer.thinking)


def _post(front, path, body, method="POST"):
  """(status, JSON body, headers) of a raw request; `body` bytes go as they are."""
  data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
  req = urllib.request.Request(f"http://localhost:{front.port}{path}", data=data, method=method,
                               headers={"content-type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=300) as r:
      return r.status, json.loads(r.read()), r.headers
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read()), e.headers


def test_models_lists_the_served_model_and_its_weights_version(api, servers, config):
  models = api.models.list().data
  assert [m.id for m in models] == [config.name]
  assert models[0].weights_version == servers[0].engine.params_version == 0
  assert models[0].max_model_len == 1280


def test_completion_token_ids_and_logprobs_equal_the_grpc_paths(api, grpc, servers, config, fmt):
  name = config.name
  want = grpc.generate(PROMPT, SamplingParams(temperature=1.0, seed=7), max_tokens=12,
                       stop_ids=[])
  raw = api.completions.with_raw_response.create(
      model=name, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, logprobs=1,
      extra_body={"return_token_ids": True, "ignore_eos": True})
  assert raw.headers[openai_http.VERSION_HEADER] == "0"
  r = raw.parse()
  c = r.choices[0]
  assert c.token_ids == want.ids and c.prompt_token_ids == PROMPT
  assert c.logprobs.token_logprobs == want.logprobs   # the same float32 values, exactly
  assert c.finish_reason == want.finish_reason == "length"
  assert c.text == fmt.tok.decode(want.ids)
  assert c.logprobs.tokens == [fmt.tok.decode([i]) for i in want.ids]
  assert r.weights_version == c.weights_version == want.weights_version == 0
  assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT), 12)
  # A text prompt is the chat tokenizer's ids; n choices draw with seed, seed + 1, ...
  text = fmt.tok.decode(PROMPT)
  r = api.completions.create(model=name, prompt=text, max_tokens=6, temperature=1.0, seed=7, n=2,
                             extra_body={"return_token_ids": True, "ignore_eos": True})
  assert [c.prompt_token_ids for c in r.choices] == [fmt.tok.encode(text)] * 2
  for i, c in enumerate(r.choices):
    g = grpc.generate(fmt.tok.encode(text), SamplingParams(temperature=1.0, seed=7 + i), 6, [])
    assert c.token_ids == g.ids


def test_stop_strings_cut_the_text_and_free_the_slot(api, servers, config):
  name = config.name
  body = dict(model=name, prompt=PROMPT, max_tokens=24, temperature=0.0)
  full = api.completions.create(**body, extra_body={"ignore_eos": True}).choices[0].text
  stop = full[len(full) // 2:len(full) // 2 + 3]
  assert stop.strip()
  r = api.completions.create(**body, stop=[stop], extra_body={"ignore_eos": True,
                                                              "return_token_ids": True})
  c = r.choices[0]
  assert c.text == full[:full.index(stop)] and c.finish_reason == "stop"
  assert len(c.token_ids) < 24
  # Streamed: the deltas add up to the same text.
  chunks = list(api.completions.create(**body, stop=[stop], stream=True,
                                       extra_body={"ignore_eos": True}))
  assert "".join(x.choices[0].text for x in chunks) == c.text
  assert chunks[-1].choices[0].finish_reason == "stop"
  deadline = time.monotonic() + 10
  while servers[0].busy_slots() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert servers[0].busy_slots() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_frees_its_slot(servers, config, stream):
  server, front = servers
  cancelled = server.driver.cancelled_requests
  conn = http.client.HTTPConnection("localhost", front.port, timeout=60)
  conn.request("POST", "/v1/completions", json.dumps({
      "model": config.name, "prompt": PROMPT, "max_tokens": 1200, "temperature": 1.0,
      "ignore_eos": True, "stream": stream}), {"content-type": "application/json"})
  deadline = time.monotonic() + 30
  while server.busy_slots() == 0:
    assert time.monotonic() < deadline
    time.sleep(0.02)
  conn.sock.shutdown(socket.SHUT_RDWR)
  conn.close()
  while server.busy_slots() or server.driver.cancelled_requests == cancelled:
    assert time.monotonic() < deadline, "the slot of a request whose client left stays busy"
    time.sleep(0.02)
  assert server.driver.cancelled_requests == cancelled + 1


def _level1_chat(config):
  """A level-1 eval task and the tools the tiny default shows the policy (compact schemas)."""
  with tempfile.TemporaryDirectory() as d:
    os.makedirs(os.path.join(d, "files"))
    os.makedirs(os.path.join(d, "apps"))
    specs = gateway.LocalGateway(d, config.envs).list_tools()
  tools = [tool_subset.compact_tool({"type": "function", "function": {
      "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}})
           for t in specs if t["name"] in tiny_cpu.LEVEL1_TOOLS]
  task = tasks.load_split(config.envs, "eval")[0]
  return task, tools


def test_chat_completion_parses_the_models_tool_call(api, grpc, config, fmt):
  task, tools = _level1_chat(config)
  messages = [{"role": "user", "content": task.prompt}]
  prompt = fmt.prompt_ids(tools, task.prompt)   # the harness's first prompt of this episode
  g = grpc.generate(prompt, SamplingParams(temperature=0.0), 72, fmt.stop_ids)
  want = fmt.parse(g.ids, {t["function"]["name"]: t["function"]["parameters"] for t in tools})
  assert want.tool_calls and want.error is None   # the tiny base calls a tool here
  r = api.chat.completions.create(model=config.name, messages=messages, tools=tools,
                                  temperature=0.0, max_tokens=72, logprobs=True,
                                  extra_body={"return_token_ids": True})
  c = r.choices[0]
  assert r.prompt_token_ids == prompt and c.token_ids == g.ids
  assert c.finish_reason == "tool_calls" and not c.message.content
  assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
      (x.name, x.arguments) for x in want.tool_calls]
  assert [x.logprob for x in c.logprobs.content] == g.logprobs
  # The call goes back as history, with the tool's result: the next prompt is the harness's.
  history = messages + [c.message.model_dump(exclude_none=True, include={"role", "content",
                                                                         "tool_calls"}),
                        {"role": "tool", "tool_call_id": c.message.tool_calls[0].id,
                         "content": "Revenue: 12.5"}]
  r2 = api.chat.completions.create(model=config.name, messages=history, tools=tools,
                                   temperature=0.0, max_tokens=8,
                                   extra_body={"return_token_ids": True})
  assert r2.prompt_token_ids == prompt + g.ids + fmt.observation_ids(g.ids, ["Revenue: 12.5"])
  # Streamed, the call arrives whole in the last chunk.
  chunks = list(api.chat.completions.create(model=config.name, messages=messages, tools=tools,
                                            temperature=0.0, max_tokens=72, stream=True))
  last = chunks[-1].choices[0]
  assert last.finish_reason == "tool_calls"
  assert [(t.function.name, t.function.arguments) for t in last.delta.tool_calls] == [
      (t.function.name, t.function.arguments) for t in c.message.tool_calls]


def _streamed_chat(api, **body):
  """(content joined from a streamed chat's deltas, its last chunk's choice)."""
  chunks = list(api.chat.completions.create(stream=True, **body))
  text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
  return text, chunks[-1].choices[0]


def test_chat_content_holds_no_control_token_unless_asked_and_never_a_tool_calls_text(
    api, config, fmt):
  """The tiny base calls a tool, then (its stop id ignored) writes on past `<|im_end|>` into a
  made-up next turn: the call is parsed, and the text after it comes without control tokens
  (with them when `skip_special_tokens` is false), streamed or not."""
  task, tools = _level1_chat(config)
  body = dict(model=config.name, messages=[{"role": "user", "content": task.prompt}],
              tools=tools, temperature=0.0, max_tokens=90)
  r = api.chat.completions.create(**body, extra_body={"ignore_eos": True,
                                                      "return_token_ids": True})
  c = r.choices[0]
  assert fmt.sp.im_end in c.token_ids and fmt.sp.im_start in c.token_ids   # sampled, as text
  assert c.message.tool_calls and c.message.content
  assert not any(s in c.message.content for s in fmt.tok.control_strings), c.message.content
  assert "<function=" not in c.message.content
  streamed, last = _streamed_chat(api, **body, extra_body={"ignore_eos": True})
  assert streamed == c.message.content and last.delta.tool_calls
  kept = api.chat.completions.create(**body, extra_body={"ignore_eos": True,
                                                         "skip_special_tokens": False})
  content = kept.choices[0].message.content
  assert "<|im_start|>" in content and "<function=" not in content, content
  assert kept.choices[0].message.tool_calls


def test_a_tool_call_the_parser_cannot_read_is_a_structured_error_not_content(api, config):
  """A call cut by max_tokens (never closed), and any call under tool_choice "none", come back
  as `tool_call_error` {message, text}: the content ends before the call, streamed or not."""
  task, tools = _level1_chat(config)
  body = dict(model=config.name, messages=[{"role": "user", "content": task.prompt}],
              tools=tools, temperature=0.0)
  for extra, why in [(dict(max_tokens=12), "not closed"),
                     (dict(max_tokens=72, tool_choice="none"), "tool_choice is 'none'")]:
    r = api.chat.completions.create(**body, **extra)
    m = r.choices[0].message
    assert not m.tool_calls and m.content == "", m
    assert why in m.tool_call_error["message"] and m.tool_call_error["text"].startswith(
        "<tool_call>\n<function="), m.tool_call_error
    streamed, last = _streamed_chat(api, **body, **extra)
    assert streamed == "" and last.delta.tool_call_error == m.tool_call_error


def test_http_and_grpc_requests_share_the_slots_at_once(api, grpc, servers, config):
  """12 requests, 6 over each front, on 4 slots: every one samples what it samples alone."""
  seeds = list(range(100, 112))
  alone = {s: grpc.generate(PROMPT, SamplingParams(temperature=1.0, seed=s), 16, []).ids
           for s in seeds}

  def over_http(seed):
    r = api.completions.create(model=config.name, prompt=PROMPT, max_tokens=16, temperature=1.0,
                               seed=seed, extra_body={"return_token_ids": True,
                                                      "ignore_eos": True})
    return r.choices[0].token_ids

  def over_grpc(seed):
    return grpc.generate(PROMPT, SamplingParams(temperature=1.0, seed=seed), 16, []).ids

  served = servers[1].requests
  with concurrent.futures.ThreadPoolExecutor(12) as pool:
    futs = {s: pool.submit(over_http if s % 2 else over_grpc, s) for s in seeds}
    got = {s: f.result() for s, f in futs.items()}
  assert got == alone
  assert servers[1].requests == served + 6


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", b"{not json", 400, "not JSON"),
    ("/v1/completions", {"prompt": [1, 2]}, 400, "'model' is required"),
    ("/v1/completions", {"model": "gpt-4", "prompt": [1, 2]}, 404, "is not served here"),
    ("/v1/completions", {"model": "M"}, 400, "'prompt' must be"),
    ("/v1/completions", {"model": "M", "prompt": [1, "x"]}, 400, "'prompt' must be"),
    ("/v1/completions", {"model": "M", "prompt": [5, 99999]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"model": "M", "prompt": [10 + i % 900 for i in range(1290)]}, 400,
     "longer than the context"),
    ("/v1/completions", {"model": "M", "prompt": [5], "max_tokens": 0}, 400, "'max_tokens'"),
    ("/v1/completions", {"model": "M", "prompt": [5], "max_tokens": "8"}, 400, "an integer"),
    ("/v1/completions", {"model": "M", "prompt": [5], "n": 0}, 400, "'n'"),
    ("/v1/completions", {"model": "M", "prompt": [5], "temperature": -1}, 400, "'temperature'"),
    ("/v1/completions", {"model": "M", "prompt": [5], "top_p": 0}, 400, "bad sampling"),
    ("/v1/completions", {"model": "M", "prompt": [5], "logprobs": 5}, 400, "'logprobs'"),
    ("/v1/completions", {"model": "M", "prompt": [5], "suffix": "x"}, 400, "not supported"),
    ("/v1/completions", {"model": "M", "prompt": [5], "stream": True, "n": 2}, 400, "one choice"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, 400, "'messages'"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "robot", "content": "x"}]},
     400, "role"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"},
                                                         {"role": "system", "content": "y"}]},
     400, "system message must come first"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "only text"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "'tool_choice'"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("/v1/embeddings", {"model": "M", "input": "x"}, 404, "no such endpoint"),
])
def test_malformed_requests_get_a_4xx_and_the_server_keeps_serving(servers, config, path, body,
                                                                    status, needle):
  front = servers[1]
  if isinstance(body, dict) and body.get("model") == "M":
    body = dict(body, model=config.name)
  code, out, headers = _post(front, path, body)
  assert code == status and needle in out["error"]["message"], out
  assert out["error"]["code"] == status and headers[openai_http.VERSION_HEADER] == "0"
  code, out, _ = _post(front, "/v1/completions", {"model": config.name, "prompt": [5, 6],
                                                  "max_tokens": 2, "temperature": 0})
  assert code == 200 and out["choices"][0]["finish_reason"] in ("stop", "length")


def test_the_openai_client_raises_on_a_refused_request(api, config):
  with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
    api.completions.create(model=config.name, prompt=[5, 99999], max_tokens=2)
  with pytest.raises(openai.NotFoundError):
    api.completions.create(model="no-such-model", prompt=[5], max_tokens=2)
  assert api.completions.create(model=config.name, prompt=[5], max_tokens=2).choices


# tgkill's syscall number where the test knows it; elsewhere the SIGINT goes to the process.
_SYS_TGKILL = {"x86_64": 234, "aarch64": 131}


def _sigint_to_a_worker_thread(p):
  """Ctrl-C as the kernel may deliver it: SIGINT to a thread of `p` other than its main one.

  A process-directed signal goes to any thread that does not block it; CPython then only sets a
  flag for its main thread. The serve process once outlived its Ctrl-C by 240 s this way (the
  main thread waiting without a timeout); the thread-directed signal makes that case certain.
  The target is the oldest such thread (a runtime thread that lives as long as the process): a
  signal sent to one thread is lost if that thread exits first, as a short-lived worker may.
  """
  with open(f"/proc/{p.pid}/status") as f:
    ignored = int(re.search(r"SigIgn:\s*([0-9a-f]+)", f.read()).group(1), 16)
  assert not ignored & (1 << (signal.SIGINT - 1)), "SIGINT is ignored in the process"
  tgkill = _SYS_TGKILL.get(platform.machine())
  tids = []
  for tid in sorted(os.listdir(f"/proc/{p.pid}/task"), key=int):
    try:
      with open(f"/proc/{p.pid}/task/{tid}/status") as f:
        blocked = int(re.search(r"SigBlk:\s*([0-9a-f]+)", f.read()).group(1), 16)
    except OSError:  # the thread ended meanwhile
      continue
    if int(tid) != p.pid and not blocked & (1 << (signal.SIGINT - 1)):
      tids.append(int(tid))
  if tgkill is None or not tids:
    p.send_signal(signal.SIGINT)
    return
  libc = ctypes.CDLL(None, use_errno=True)
  assert libc.syscall(tgkill, p.pid, tids[0], signal.SIGINT) == 0, os.strerror(ctypes.get_errno())


# launch.py with SIGINT at its default, as a terminal starts it. A test run from a background
# job (`cmd &` where the shell has no job control, as CI runners and `nohup ... &` start it)
# inherits SIGINT ignored, exec keeps it ignored, and Python leaves an ignored SIGINT ignored:
# the Ctrl-C below would then never arrive (the cause of this test's hangs in such runs).
_AS_FROM_A_TERMINAL = ("import runpy, signal, sys; "
                       "signal.signal(signal.SIGINT, signal.default_int_handler); "
                       "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


_STREAMS_HTTP, _STREAMS_GRPC = 28, 4   # 32 streams open when the signal arrives


class _Progress:
  """Counts, across client threads, the streams the server accepted and those decoding."""

  def __init__(self):
    self._lock = threading.Lock()
    self.accepted = self.decoding = 0

  def add(self, what: str) -> None:
    with self._lock:
      setattr(self, what, getattr(self, what) + 1)


def _http_stream(port, model, max_tokens, progress):
  """One streamed completion read to its end: ("complete", finish) after a finish reason and
  [DONE]; ("error", error) after an error event and [DONE]; ("cut", why) for anything else (the
  stream broke, ended without either, or stalled 30 s)."""
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
  try:
    conn.request("POST", "/v1/completions", json.dumps({
        "model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 1.0,
        "ignore_eos": True, "stream": True}), {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
      return "cut", f"status {r.status}: {r.read()[:200]!r}"
    progress.add("accepted")  # the front queues the request as it starts the body
    finish, error, tokens = None, None, 0
    for line in r:
      if line.strip() == b"data: [DONE]":
        return ("error", error) if error else ("complete", finish) if finish else (
            "cut", f"[DONE] after {tokens} tokens without a finish reason or an error")
      if not line.startswith(b"data: "):
        continue
      event = json.loads(line[6:])
      if "error" in event:
        error = event["error"]["type"]
        continue
      tokens += 1
      if tokens == 1:
        progress.add("decoding")
      finish = event["choices"][0]["finish_reason"] or finish
    return "cut", f"the body ended after {tokens} tokens without [DONE]"
  except (OSError, http.client.HTTPException) as e:
    return "cut", repr(e)
  finally:
    conn.close()


def _grpc_stream(address, max_tokens, progress):
  """One gRPC Decode stream read to its end: ("complete", finish), ("error", status code name)
  or ("cut", why) when it ended without a finish reason."""
  client = TokenClient(address)
  tokens, finish = 0, ""
  try:
    for resp in client.stream([5, 6, 7], SamplingParams(1.0), max_tokens, [], timeout_s=30):
      for s in resp.stream_content.samples:
        tokens += 1
        if tokens == 1:
          progress.add("accepted")
          progress.add("decoding")
        finish = s.finish_reason or finish
  except grpc_lib.RpcError as e:
    return "error", e.code().name
  finally:
    client.close()
  return ("complete", finish) if finish else ("cut", f"{tokens} tokens, no finish reason")


def _wait_until(what, deadline):
  while not what():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_launch_serves_both_fronts_and_a_signal_stops_it_within_10s_with_32_streams_open(
    tmp_path, sig):
  """`launch.py --mode=serve --http_port=0` (the shipped tiny base): both fronts answer the
  same ids; then, with 32 streams open (4 gRPC, 28 HTTP; 8 decoding in the slots, the rest
  queued), Ctrl-C (SIGINT, delivered to a worker thread) or SIGTERM ends the process with code 0
  within 10 s, and every stream got either its whole answer or an error saying the server stops
  (an error event then [DONE] over HTTP, UNAVAILABLE over gRPC): none cut off or left hanging."""
  slots, max_len = 8, 1024
  cmd = [sys.executable, "-c", _AS_FROM_A_TERMINAL, "launch.py", "--mode=serve",
         "--config=configs/tiny_cpu.py", "--port=0",
         "--http_port=0", "--config.rollout.warmup=False", f"--config.rollout.max_len={max_len}",
         "--config.rollout.prefill_buckets=(16,)", "--config.rollout.prefix_cache=False",
         f"--config.rollout.slots={slots}", f"--config.train.max_context={max_len}",
         f"--config.workdir={tmp_path}"]
  p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  pool = concurrent.futures.ThreadPoolExecutor(_STREAMS_HTTP + _STREAMS_GRPC)
  try:
    line = ""
    deadline = time.monotonic() + 300  # imports and compile; minutes on a loaded 2-core machine
    while "serving on" not in line:
      line = p.stdout.readline()
      assert line or p.poll() is None, "launch.py exited before serving"
      assert time.monotonic() < deadline
    grpc_address = "127.0.0.1:" + re.search(r"serving on localhost:(\d+)", line).group(1)
    http_url = re.search(r"\((http://localhost:\d+/v1),", line).group(1)
    http_port = int(http_url.split(":")[2].split("/")[0])
    api = openai.OpenAI(base_url=http_url, api_key="unused", max_retries=0, timeout=120)
    r = api.completions.create(model="tiny_cpu", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                               extra_body={"return_token_ids": True, "ignore_eos": True})
    g = TokenClient(grpc_address).generate([5, 6, 7], SamplingParams(0.0), 4, [])
    assert r.choices[0].token_ids == g.ids and r.weights_version == 0
    # The output is drained from here on (a full pipe would block the server's prints).
    out = []
    drain = threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)
    drain.start()
    # Under load: every slot decoding a long answer (max_tokens fills the slot), the other
    # streams queued behind them. The gRPC streams go first and hold slots before HTTP's come.
    progress, budget = _Progress(), max_len - 3
    streams = [pool.submit(_grpc_stream, grpc_address, budget, progress)
               for _ in range(_STREAMS_GRPC)]
    deadline = time.monotonic() + 120
    _wait_until(lambda: progress.decoding == _STREAMS_GRPC, deadline)
    streams += [pool.submit(_http_stream, http_port, "tiny_cpu", budget, progress)
                for _ in range(_STREAMS_HTTP)]
    _wait_until(lambda: progress.accepted == len(streams) and progress.decoding >= slots,
                deadline)
    assert not any(s.done() for s in streams), [s.result() for s in streams if s.done()]
    # The signal; a shutdown past the bound is aborted, and the process's thread stacks
    # (absl's faulthandler prints them on SIGABRT) are the failure.
    t0 = time.monotonic()
    if sig == signal.SIGINT:
      _sigint_to_a_worker_thread(p)
    else:
      p.send_signal(sig)
    try:
      code = p.wait(10)
    except subprocess.TimeoutExpired:
      p.send_signal(signal.SIGABRT)
      p.wait(30)
      drain.join(10)
      pytest.fail(f"launch.py --mode=serve still running 10 s after {sig.name} with 32 streams "
                  "open:\n" + "".join(out)[-6000:])
    stop_s = time.monotonic() - t0
    drain.join(10)
    print(f"{sig.name}: stopped in {stop_s:.2f} s with {len(streams)} streams open")
    assert code == 0, "".join(out)[-3000:]
    outcomes = [s.result(timeout=30) for s in streams]
    bad = [o for o in outcomes if o[0] == "cut"
           or o[0] == "error" and o[1] not in ("UNAVAILABLE", openai_http.SHUTTING_DOWN)]
    assert not bad, f"{len(bad)} of {len(outcomes)} streams: {bad[:4]}"
    assert sum(o[0] == "error" for o in outcomes) >= len(streams) - slots  # queued: no answer
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
    pool.shutdown(wait=False, cancel_futures=True)


def test_serve_signals_stop_it_once_then_act_as_default_and_an_ignored_one_stays_ignored():
  """serve's signal handling, in this process: SIGTERM raises KeyboardInterrupt (the serve
  loop's stop) and is recorded; from then on it has its default action again, so a second
  signal ends a stop that hangs; SIGINT, ignored when entering (a background job), stays
  ignored; on leaving, the handlers are as before."""
  before_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # else the kill below is not ours
    with serve._signals_stop_serving() as got:  # pylint: disable=protected-access
      assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
      assert callable(signal.getsignal(signal.SIGTERM))
      with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler runs at the next bytecode, long before this ends
      assert [name for name, _ in got] == ["SIGTERM"]
      assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  finally:
    signal.signal(signal.SIGINT, before_int)
