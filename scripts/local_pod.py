"""A pod on this machine: N processes of one JAX job, each with K fake CPU devices.

    python scripts/local_pod.py --processes 2 --devices_per_process 4 -- \
        --config=configs/tiny_cpu.py --mode=rl

starts `launch.py <arguments after -->` N times with the variables `jax.distributed` reads
(JAX_COORDINATOR_ADDRESS on 127.0.0.1 and a free port, JAX_NUM_PROCESSES, JAX_PROCESS_ID),
JAX_PLATFORMS=cpu and XLA_FLAGS giving each process K devices; their collectives run over gloo
(config.distributed.cpu_collectives). Process 0's output streams to this console; the others'
go to files under --log_dir. Returns 0 when every process does, else the first failure's code
(a process that dies stops the others through the runtime's heartbeat; any still running
--grace_s later are killed).

The same job on real hosts: every host runs the same `launch.py` command with those variables
set (a TPU pod: `gcloud compute tpus tpu-vm ssh NAME --worker=all --command="..."`, where JAX
finds its peers by itself; a GPU cluster: `srun` with JAX_COORDINATOR_ADDRESS set to the first
host and JAX_NUM_PROCESSES / JAX_PROCESS_ID from SLURM_NTASKS / SLURM_PROCID).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(index: int, processes: int, devices: int, port: int, base=None) -> dict:
  """The environment of process `index`: coordinator, process count and id, K CPU devices, and
  NPROC, the size of XLA's CPU thread pool.

  Why NPROC: XLA's CPU client sizes its intra-op pool as max(NPROC or the cores, its local
  devices) and compiles each program for that pool (how a matmul's contraction is blocked, how
  loops are split), so with more fake devices than cores a 1 x 8 job and a 2 x 4 job would round
  differently (measured: MoE expert gradients 4e-9 apart, 7e-7 in the weights after one Adam
  step). The same pool in every process, the job's device count or the cores when more, makes
  the bits independent of how the devices are split over processes. A NPROC already set wins."""
  env = dict(os.environ if base is None else base)
  env.setdefault("NPROC", str(max(os.cpu_count() or 1, processes * devices)))
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
  env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
             JAX_PROCESS_ID=str(index), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip())
  return env


def start(commands: list, devices: int, log_dir: str, port: int = 0,
          console: bool = True, base_env: dict = None) -> list:
  """Starts process i as `commands[i]` (an argv list); returns the Popen objects. Process 0
  writes to this console (to log_dir/process_0.log too with console=False), process i > 0 to
  log_dir/process_i.log. Each process's environment is `process_env` over `base_env` (this
  process's when None)."""
  port = port or free_port()
  os.makedirs(log_dir, exist_ok=True)
  procs = []
  for i, cmd in enumerate(commands):
    out = (None if i == 0 and console else
           open(os.path.join(log_dir, f"process_{i}.log"), "w"))
    env = process_env(i, len(commands), devices, port, base_env)
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env,
                                  stdout=out, stderr=subprocess.STDOUT if out else None))
  return procs


def wait(procs: list, grace_s: float) -> int:
  """Waits for every process; after the first failure, gives the others `grace_s` to stop by
  themselves, then kills them. Returns 0 or the first failure's exit code."""
  first_failure, failed_at = 0, None
  while True:
    codes = [p.poll() for p in procs]
    for c in codes:
      if c not in (None, 0) and not first_failure:
        first_failure, failed_at = c, time.monotonic()
    if all(c is not None for c in codes):
      return first_failure
    if failed_at is not None and time.monotonic() - failed_at > grace_s:
      for p in procs:
        if p.poll() is None:
          p.kill()
    time.sleep(0.2)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--processes", type=int, default=2)
  ap.add_argument("--devices_per_process", type=int, default=4)
  ap.add_argument("--log_dir", default="", help="where processes 1.. write; default a new temp dir")
  ap.add_argument("--grace_s", type=float, default=60.0,
                  help="after one process fails, how long the others may take to stop")
  ap.add_argument("launch_args", nargs=argparse.REMAINDER, help="-- then launch.py's arguments")
  args = ap.parse_args(argv)
  rest = args.launch_args[1:] if args.launch_args[:1] == ["--"] else args.launch_args
  if args.processes < 1 or args.devices_per_process < 1:
    ap.error("--processes and --devices_per_process must be at least 1")
  log_dir = args.log_dir or tempfile.mkdtemp(prefix="local_pod-")
  cmd = [sys.executable, os.path.join(ROOT, "launch.py")] + rest
  procs = start([cmd] * args.processes, args.devices_per_process, log_dir)
  if args.processes > 1:
    print(f"local pod: {args.processes} processes x {args.devices_per_process} CPU devices; "
          f"processes 1..{args.processes - 1} write to {log_dir}", file=sys.stderr, flush=True)
  try:
    code = wait(procs, args.grace_s)
  except KeyboardInterrupt:
    for p in procs:
      p.send_signal(signal.SIGINT)
    code = wait(procs, 10.0) or 130
  if code:
    print(f"local pod: a process failed (exit code {code}); logs of processes 1.. in {log_dir}",
          file=sys.stderr, flush=True)
  return code


if __name__ == "__main__":
  sys.exit(main())
