"""Sandboxed code execution: each attack is stopped and reported as such; the gateway survives."""
import os
import time

import pytest

from configs import base
from envs import sandbox
from envs import worlds
from envs.apps import gateway as gateway_lib
from envs.apps import worldstate


@pytest.fixture(scope="module")
def cfg():
  c = base.get_config().envs
  c.sandbox.cpu_s = 2
  c.sandbox.wall_s = 4.0
  c.sandbox.memory_mb = 512
  c.sandbox.max_processes = 16
  c.sandbox.file_size_mb = 4
  c.tool_time_limit_s = 15.0
  return c


@pytest.fixture()
def files_dir(tmp_path):
  d = tmp_path / "world" / "files"
  d.mkdir(parents=True)
  (d / "data.txt").write_text("42\n")
  return str(d)


def _run(code, files_dir, cfg):
  return sandbox.run_python(code, files_dir, cfg.sandbox, 2000)


def test_isolation_is_reported(cfg):
  iso = sandbox.isolation(cfg.sandbox)
  assert "rlimits" in iso
  print("isolation:", iso)


def test_normal_code_runs_in_the_world(files_dir, cfg):
  r = _run("print(open('data.txt').read().strip()); open('out.txt', 'w').write('ok')", files_dir, cfg)
  assert r.status == "ok" and r.stdout.strip() == "42"
  assert open(os.path.join(files_dir, "out.txt")).read() == "ok"


def test_cpu_loop_is_stopped(files_dir, cfg):
  t = time.monotonic()
  r = _run("while True: pass", files_dir, cfg)
  assert r.status in ("cpu_limit", "timeout"), r
  assert time.monotonic() - t < cfg.sandbox.wall_s + 3


def test_sleeping_code_hits_the_wall_clock(files_dir, cfg):
  r = _run("import time, subprocess\nsubprocess.Popen(['sleep', '100'])\ntime.sleep(100)", files_dir, cfg)
  assert r.status == "timeout", r
  time.sleep(0.2)
  assert "sleep 100" not in os.popen("ps -eo args").read()  # the whole group is gone


def test_memory_bomb_is_stopped(files_dir, cfg):
  r = _run("x = bytearray(8 * 1024 ** 3)", files_dir, cfg)
  assert r.status == "memory_limit", r
  r = _run("x = []\nwhile True: x.append(b'x' * 10 ** 7)", files_dir, cfg)
  assert r.status == "memory_limit", r


def test_fork_bomb_is_stopped(files_dir, cfg):
  t = time.monotonic()
  r = _run("import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass", files_dir, cfg)
  assert r.status == "process_limit", r
  assert time.monotonic() - t < cfg.sandbox.wall_s + 5


def test_network_is_blocked(files_dir, cfg):
  if "namespaces" not in sandbox.isolation(cfg.sandbox):
    pytest.skip("no user namespaces on this kernel: network isolation unavailable")
  r = _run("import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)", files_dir, cfg)
  assert r.status == "network_blocked", r


def test_writes_outside_the_world_are_blocked(files_dir, cfg, tmp_path):
  target = tmp_path / "outside.txt"
  r = _run(f"open({str(target)!r}, 'w').write('x')", files_dir, cfg)
  assert r.status == "write_blocked", r
  # Around the Python-level hook (a shell), the read-only mount still holds.
  if "namespaces" in sandbox.isolation(cfg.sandbox):
    r = _run(f"import subprocess; subprocess.run(['sh', '-c', 'echo x > {target}'], check=True)",
             files_dir, cfg)
    assert r.status == "write_blocked" or "Read-only file system" in r.stderr, r
  assert not target.exists()


def test_file_size_limit(files_dir, cfg):
  r = _run("open('big.bin', 'wb').write(b'0' * (16 * 1024 * 1024))", files_dir, cfg)
  assert r.status == "file_size_limit", r


def test_gateway_keeps_serving_after_attacks(cfg, tmp_path):
  spec = worlds.spec_for(cfg, "management_consulting", 5)
  worlds.generate_world(cfg, spec, str(tmp_path / "w"))
  inst = worldstate.WorldInstance(str(tmp_path / "w"), str(tmp_path / "work"))
  with gateway_lib.Gateway(inst.path, cfg) as gw:
    for code, status in (("import os\nwhile True: os.fork()", "process_limit"),
                         ("x = bytearray(8 * 1024 ** 3)", "memory_limit"),
                         ("open('/tmp/evil_sandbox_test', 'w')", "write_blocked")):
      r = gw.call_tool("code_execution_run_python", {"code": code})
      assert not r.is_error and f"status: {status}" in r.text, r.text
    r = gw.call_tool("code_execution_run_python", {"code": "print(sorted(__import__('os').listdir('.')))"})
    assert "status: ok" in r.text and "decks" in r.text
    assert not gw.call_tool("mail_list_contacts", {}).is_error
  assert not os.path.exists("/tmp/evil_sandbox_test")
