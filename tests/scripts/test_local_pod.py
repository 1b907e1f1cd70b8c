"""scripts/local_pod.py: two processes of one JAX job on this machine (gloo collectives on
127.0.0.1, fake CPU devices): work shared and exchanged, collectives across processes, a killed
process stopping the other, and a run refused when the processes' configs differ."""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts"))

import local_pod  # noqa: E402  (scripts/ is not a package)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = os.path.join(ROOT, "tests", "rl", "distributed_program.py")


def _log(tmp_path, i):
  with open(tmp_path / f"process_{i}.log") as f:
    return f.read()


def test_two_processes_share_work_exchange_it_and_sum_over_every_device(tmp_path):
  procs = local_pod.start([[sys.executable, PROGRAM, ROOT, "30"]] * 2, 4, str(tmp_path),
                          console=False)
  assert local_pod.wait(procs, 30) == 0, _log(tmp_path, 0)[-3000:] + _log(tmp_path, 1)[-3000:]
  for i in range(2):
    # Each gathered the other's share in process order; 4 devices x 1.0 + 4 x 2.0.
    assert (f"process {i} of 2: 4 of 8 devices; gathered [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]; "
            f"sum 12.0") in _log(tmp_path, i)


def test_one_process_through_the_coordinator_sums_over_devices_as_two_processes_do_to_the_bit(
    tmp_path):
  digests = []
  for processes in (1, 2):
    log_dir = tmp_path / str(processes)
    procs = local_pod.start([[sys.executable, PROGRAM, ROOT, "30", "bits"]] * processes,
                            8 // processes, str(log_dir), console=False)
    assert local_pod.wait(procs, 30) == 0, _log(log_dir, 0)[-3000:]
    digests.append(_log(log_dir, 0).split("bits ")[1].split()[0])
  assert digests[0] == digests[1]


def test_a_killed_process_stops_the_other_within_the_heartbeat_bound(tmp_path):
  heartbeat_s = 10
  procs = local_pod.start([[sys.executable, PROGRAM, ROOT, str(heartbeat_s), "loop"]] * 2, 4,
                          str(tmp_path), console=False)
  try:
    deadline = time.monotonic() + 240
    while "sum 12.0" not in _log(tmp_path, 1) and time.monotonic() < deadline:
      assert procs[0].poll() is None and procs[1].poll() is None, _log(tmp_path, 0)[-3000:]
      time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # The bound: the heartbeat timeout plus the runtime's polling and abort (measured ~6 s with
    # a 10 s timeout on 2 cores).
    while procs[0].poll() is None and time.monotonic() - killed < heartbeat_s + 30:
      time.sleep(0.2)
    assert procs[0].poll() not in (None, 0)
    assert "another task died" in _log(tmp_path, 0) or "unhealthy" in _log(tmp_path, 0)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def test_processes_with_different_overrides_stop_naming_the_keys_that_differ(tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "launch.py"), "--mode=model",
         "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"), f"--config.workdir={tmp_path}"]
  procs = local_pod.start([cmd, cmd + ["--config.seed=7", "--config.train.steps=3"]], 1,
                          str(tmp_path), console=False)
  assert local_pod.wait(procs, 60) != 0
  for i in range(2):
    log = _log(tmp_path, i)
    assert "every process of one job must run the same command" in log, log[-3000:]
    assert "process 1 runs another config than process 0: seed=7 (process 0: 0)" in log
    assert "train.steps=3" in log
    assert "scored a batch" not in log   # stopped before the mode ran


def test_a_scripted_eval_split_over_two_processes_reports_what_one_process_does(tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "launch.py"), "--mode=eval",
         "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"), "--config.policy=oracle",
         "--config.eval.max_tasks=12",
         "--config.eval.split=eval", "--config.eval.concurrency=2"]
  reports = []
  for processes in (1, 2):
    log_dir = tmp_path / str(processes)
    procs = local_pod.start([cmd] * processes, 1, str(log_dir), console=False)
    assert local_pod.wait(procs, 60) == 0, _log(log_dir, 0)[-3000:]
    log = _log(log_dir, 0)
    assert f"tasks=12 ({12 // processes} in this process)" in log
    reports.append(log.strip().splitlines()[-1])   # the summary as one line of JSON
    if processes == 2:
      assert "{" not in _log(log_dir, 1)   # process 1 ran its block and printed nothing
  assert reports[0] == reports[1] and '"pass_at_1": 1.0' in reports[0]


def test_each_process_gets_the_coordinator_its_id_and_its_own_cpu_devices():
  env = local_pod.process_env(1, 2, 4, 1234, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"})
  assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234"
  assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"], env["JAX_PLATFORMS"]) == ("2", "1", "cpu")
  assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
  assert int(env["NPROC"]) == max(os.cpu_count(), 8)   # one pool size whatever the split
  assert local_pod.process_env(0, 1, 8, 1234, base={})["NPROC"] == env["NPROC"]
