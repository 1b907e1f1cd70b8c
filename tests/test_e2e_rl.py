"""End to end: launch.py --mode=rl through the real JetStream server, worlds and orbax checkpoints.

A run on a very small config takes RL steps (rollouts through the gRPC server and the agent
pool on real worlds, train step, weight sync), checkpoints every step, is killed with SIGKILL
after its first checkpoint, and a second launch with the same name resumes from the newest
checkpoint and finishes, writing summary.json (slow, minutes on 2 cores: --run-slow). Two
steps with the rollout server as a separate job (`launch.py --mode=serve` watching the weights
directory the trainer publishes to; slow, ~1 min). And make run's path from a fresh run
directory (SFT first) with rollouts drawn a step ahead (loop.max_staleness=1; ~1.5 min, in
`make test`).
"""
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cmd(tmp_path, steps):
  return [sys.executable, os.path.join(ROOT, "launch.py"), "--mode=rl",
          "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"),
          f"--config.workdir={tmp_path}", "--config.name=e2e",
          f"--config.envs.worlds_root={os.path.join(ROOT, 'runs/worlds')}",
          "--config.sft.steps=0", "--config.loop.eval_max_tasks=2",
          f"--config.train.steps={steps}", "--config.train.prompts_per_step=1",
          "--config.train.samples_per_prompt=2", "--config.train.micro_batches=1",
          "--config.checkpoint.save_every=1",
          "--config.checkpoint.async_save=False", "--config.harness.num_workers=2",
          "--config.harness.max_tokens_per_turn=16", "--config.harness.max_turns=1",
          "--config.loop.progress=False",
          "--config.loop.bootstrap=100"]


def _env():
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)  # one CPU device: the conftest's fake devices only slow this down
  return env


def _steps(ckpt_dir):
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())


@pytest.mark.slow
def test_rl_two_steps_then_sigkill_and_resume(tmp_path, launched_job_env):
  env = launched_job_env
  ckpt_dir = os.path.join(tmp_path, "e2e", "checkpoints")
  log1 = open(os.path.join(tmp_path, "run1.log"), "w")
  p = subprocess.Popen(_cmd(tmp_path, 4), cwd=ROOT, env=env, stdout=log1,
                       stderr=subprocess.STDOUT)
  deadline = time.monotonic() + 1500
  try:
    while time.monotonic() < deadline and p.poll() is None and len(_steps(ckpt_dir)) < 2:
      time.sleep(2)
    assert p.poll() is None, open(os.path.join(tmp_path, "run1.log")).read()[-4000:]
    assert _steps(ckpt_dir)[-1] >= 2, "two RL steps were not checkpointed in time"
  finally:
    if p.poll() is None:
      os.kill(p.pid, signal.SIGKILL)
    p.wait()
  killed_at = _steps(ckpt_dir)[-1]
  assert killed_at < 4
  metrics = [json.loads(l) for l in open(os.path.join(tmp_path, "e2e", "metrics.jsonl"))]
  train = [m for m in metrics if m["phase"] == "train"]
  assert len(train) >= 2 and all("loss/total" in m and "mean_reward" in m for m in train)

  out = subprocess.run(_cmd(tmp_path, 4), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1500)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  assert f"resumed from checkpoint step {killed_at}" in out.stdout + out.stderr
  assert _steps(ckpt_dir)[-1] == 4
  summary = json.load(open(os.path.join(tmp_path, "e2e", "summary.json")))
  for k in ("before_rl", "after_rl"):
    assert 0.0 <= summary[k]["pass_at_1"] <= 1.0
    lo, hi = summary[k]["pass_at_1_ci95"]
    assert lo <= summary[k]["pass_at_1"] <= hi
  train = [json.loads(l) for l in open(os.path.join(tmp_path, "e2e", "metrics.jsonl"))]
  steps = sorted({m["step"] for m in train if m["phase"] == "train"})
  assert steps[-1] == 4


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


# Slow (`make test-all`, CI; two launches, ~1 min): `make test` keeps its 20-minute budget, and
# its end-to-end run is the SFT-then-RL test below, with the server in the job.
@pytest.mark.slow
def test_rl_steps_with_the_rollout_server_as_a_separate_job(tmp_path, launched_job_env):
  env = launched_job_env
  port = _free_port()
  weights = os.path.join(tmp_path, "weights")
  serve_log = open(os.path.join(tmp_path, "serve.log"), "w")
  server = subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "launch.py"), "--mode=serve",
       "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"), f"--port={port}",
       f"--config.rollout.weights_dir={weights}", "--config.rollout.warmup=False"],
      cwd=ROOT, env=env, stdout=serve_log, stderr=subprocess.STDOUT)
  try:
    out = subprocess.run(
        _cmd(tmp_path, 2) + [f"--config.rollout.servers=('localhost:{port}',)",
                             f"--config.rollout.weights_dir={weights}",
                             "--config.rollout.sync_timeout_s=300"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert server.poll() is None, "the rollout server exited"
  finally:
    server.terminate()
    server.wait(timeout=60)
  log = open(os.path.join(tmp_path, "serve.log")).read()
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:] + log[-2000:]
  # Version 0 (the start) for the eval before RL, then one version a step.
  for v in (0, 1, 2):
    assert f"serving weights version {v} from {weights}" in log, log[-3000:]
  summary = json.load(open(os.path.join(tmp_path, "e2e", "summary.json")))
  assert 0.0 <= summary["after_rl"]["pass_at_1"] <= 1.0
  metrics = [json.loads(l) for l in open(os.path.join(tmp_path, "e2e", "metrics.jsonl"))]
  assert sorted(m["step"] for m in metrics if m["phase"] == "train") == [1, 2]


def test_sft_first_then_rl_steps_with_rollouts_drawn_one_step_ahead_and_turns_kept(tmp_path):
  """make run's path on a fresh run directory (SFT trained first, then RL), with
  loop.max_staleness=1: each step's batch is drawn while the previous step trains; and the
  turn cache on (finished slots held, turns kept) across those weight syncs; then the run
  directory records its config and refuses a rerun under another learning rate."""
  env = _env()
  cmd = [a for a in _cmd(tmp_path, 3) if a != "--config.sft.steps=0"]
  cmd += ["--config.loop.max_staleness=1", "--config.rollout.turn_cache=8", "--config.sft.steps=1",
          "--config.sft.max_tasks=2", "--config.sft.batch_size=2"]
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  assert os.path.isdir(os.path.join(tmp_path, "e2e", "sft"))
  metrics = [json.loads(l) for l in open(os.path.join(tmp_path, "e2e", "metrics.jsonl"))]
  train = {m["step"]: m for m in metrics if m["phase"] == "train"}
  assert sorted(train) == [1, 2, 3]
  # Step 0's batch is drawn from the start weights; later ones while the step before trains.
  assert [train[s]["rollout/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
  # The engine's counters reach the metrics: the shared prefix is read, not prefilled; turns
  # are kept (these one-turn episodes continue none: tests/rl/rollout/test_turn_cache.py).
  assert train[3]["rollout/prefilled_tokens"] < 0.5 * train[3]["rollout/prompt_tokens"]
  assert train[3]["rollout/turns_kept"] > 0
  summary = json.load(open(os.path.join(tmp_path, "e2e", "summary.json")))
  assert 0.0 <= summary["after_rl"]["pass_at_1"] <= 1.0
  # The run directory holds this run: its config, which the summary names by hash, and one
  # start in the history. The same directory under another learning rate is refused before
  # anything in it changes (rl/run_record.py).
  record = json.load(open(os.path.join(tmp_path, "e2e", "run_config.json")))
  assert summary["config_hash"] == record["config_hash"]
  assert record["config"]["loop.max_staleness"] == 1
  before = _hashes(os.path.join(tmp_path, "e2e"))
  again = subprocess.run(cmd + ["--config.optim.lr=0.5"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
  assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
  assert "  optim.lr: 0.2 -> 0.5" in again.stderr.splitlines()
  assert _hashes(os.path.join(tmp_path, "e2e")) == before


def _hashes(directory) -> dict:
  """Relative path -> sha256 of every file under `directory`."""
  out = {}
  for dirpath, _, files in os.walk(directory):
    for name in files:
      with open(os.path.join(dirpath, name), "rb") as f:
        out[os.path.relpath(os.path.join(dirpath, name), directory)] = \
            hashlib.sha256(f.read()).hexdigest()
  return out
