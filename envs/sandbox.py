"""Sandboxed Python execution for the code_execution app.

One run = one subprocess tree:
  parent (this module) -- Popen, own session (killpg-able), rlimits set before exec
    unshare --user --map-root-user --net --mount --pid --fork --kill-child   (when available)
      boot (pid 1 of the namespace): remounts every mount read-only except the world's files/,
      drops all capabilities, installs an audit hook refusing writes outside files/, forks
        worker: exec()s the user's code (read from stdin) with cwd = files/

Limits and how they surface (SandboxResult.status):
  wall clock      -> parent kills the whole process group              "timeout"
  RLIMIT_CPU      -> SIGXCPU / SIGKILL                                 "cpu_limit"
  RLIMIT_AS       -> MemoryError or a kill                             "memory_limit"
  RLIMIT_FSIZE    -> EFBIG ("File too large")                          "file_size_limit"
  process count   -> parent watchdog counts the session, kills it      "process_limit"
  no network      -> empty network namespace: ENETUNREACH              "network_blocked"
  read-only world -> EROFS / audit-hook PermissionError                "write_blocked"
RLIMIT_NPROC is set too, but the kernel does not apply it to root, which is why a watchdog
counts processes. Without user namespaces the run still gets rlimits, its own session and the
audit hook; `isolation()` says which level is in effect.
"""
import dataclasses
import functools
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# Runs inside the sandbox as `python -I -c _BOOT <files_dir> <use_mounts>`; stdin = user code.
_BOOT = r'''
import ctypes, os, sys
root, use_mounts = os.path.realpath(sys.argv[1]), sys.argv[2] == "1"
code = sys.stdin.read()
if use_mounts:
  libc = ctypes.CDLL(None, use_errno=True)
  MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
  MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
  flagmap = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
             "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
  if libc.mount(root.encode(), root.encode(), None, MS_BIND | MS_REC, None) != 0:
    raise SystemExit("sandbox: bind of the world failed: errno %d" % ctypes.get_errno())
  mounts = []
  with open("/proc/self/mountinfo") as f:
    for line in f:
      parts = line.split()
      mounts.append((parts[4].replace("\\040", " "), parts[5]))
  for mp, opts in mounts:
    if mp == root or mp.startswith(root + "/") or mp == "/proc" or mp.startswith("/proc/"):
      continue
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY
    for o in opts.split(","):
      flags |= flagmap.get(o, 0)
    libc.mount(None, mp.encode(), None, flags, None)  # best effort: a locked mount stays as is
  PR_CAPBSET_DROP = 24
  for cap in range(64):
    libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
  class Hdr(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
  class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]
  libc.capset(ctypes.byref(Hdr(0x20080522, 0)), (Data * 2)())
os.chdir(root)
os.environ["TMPDIR"] = root
os.environ["HOME"] = root

def _inside(p):
  try:
    p = os.path.realpath(os.fsdecode(p) if not isinstance(p, int) else "/dev/fd/%d" % p)
  except Exception:
    return False
  return p == root or p.startswith(root + "/") or p.startswith("/dev/")

def _hook(event, args):
  if event == "open":
    path, mode, flags = args
    writing = (mode and any(c in str(mode) for c in "wax+")) or (flags and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    if writing and path is not None and not isinstance(path, int) and not _inside(path):
      raise PermissionError("sandbox: write outside the world refused: %s" % (path,))
  elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.replace", "os.chmod",
                 "os.chown", "os.truncate", "os.symlink", "os.link", "os.utime", "shutil.rmtree"):
    for p in args[:2]:
      if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p):
        raise PermissionError("sandbox: write outside the world refused: %s" % (p,))

pid = os.fork()
if pid == 0:
  sys.addaudithook(_hook)
  g = {"__name__": "__main__", "__builtins__": __builtins__}
  try:
    exec(compile(code, "<code>", "exec"), g)
  except SystemExit as e:
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
  except BaseException:
    import traceback
    traceback.print_exc()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(1)
  sys.stdout.flush(); sys.stderr.flush()
  os._exit(0)
_, status = os.waitpid(pid, 0)
sys.stdout.flush()
if os.WIFSIGNALED(status):
  os._exit(128 + os.WTERMSIG(status))
os._exit(os.WEXITSTATUS(status))
'''

_UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork",
            "--kill-child"]


@dataclasses.dataclass
class SandboxResult:
  status: str          # ok | error | timeout | cpu_limit | memory_limit | file_size_limit |
                       # process_limit | network_blocked | write_blocked | cancelled
  exit_code: int       # the worker's exit code; 128+N when killed by signal N; -9 when we killed it
  stdout: str
  stderr: str
  wall_s: float
  isolation: str

  def to_text(self) -> str:
    out = [f"status: {self.status} (exit code {self.exit_code}, {self.wall_s:.2f}s)"]
    if self.stdout:
      out.append("stdout:\n" + self.stdout)
    if self.stderr:
      out.append("stderr:\n" + self.stderr)
    return "\n".join(out)


@functools.lru_cache(maxsize=None)
def _namespaces_work() -> bool:
  if shutil.which("unshare") is None:
    return False
  try:
    p = subprocess.run(_UNSHARE + [sys.executable, "-I", "-B", "-c", _BOOT, tempfile.gettempdir(), "1"],
                       input="print('ok')", capture_output=True, text=True, timeout=30)
    return p.returncode == 0 and p.stdout.strip() == "ok"
  except (OSError, subprocess.SubprocessError):
    return False


def isolation(sandbox_cfg) -> str:
  """The isolation level runs get with these settings, as one line."""
  base = "rlimits(cpu,as,fsize,nofile,core)+session-kill+process-watchdog+write-audit-hook"
  if sandbox_cfg.namespaces and _namespaces_work():
    return "namespaces(user,net,mount-ro,pid)+caps-dropped+" + base
  return base + " (no namespaces: network NOT isolated)"


def _count_session(sid: int) -> int:
  n = 0
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        stat = f.read()
    except OSError:
      continue
    fields = stat[stat.rfind(b")") + 2:].split()
    if len(fields) > 3 and int(fields[3]) == sid:
      n += 1
  return n


def _count_tree(pid: int, limit: int) -> int:
  """Processes in the tree under pid (stops counting past limit). Inside a pid namespace every
  orphan is re-parented to the namespace's init, so the tree is the whole run."""
  n, todo = 0, [pid]
  while todo and n <= limit:
    p = todo.pop()
    n += 1
    try:
      for tid in os.listdir(f"/proc/{p}/task"):
        with open(f"/proc/{p}/task/{tid}/children") as f:
          todo += [int(c) for c in f.read().split()]
    except (OSError, ValueError):
      continue
  return n


def _kill_session(pgid: int):
  for _ in range(50):
    try:
      os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
      return
    time.sleep(0.01)
    if _count_session(pgid) == 0:
      return


_NET_RE = re.compile(r"Network is unreachable|Errno 101|name resolution|Name or service not known|"
                     r"Errno -3|Errno -2|Cannot assign requested address")


def run_python(code: str, files_dir: str, sandbox_cfg, output_chars: int,
               cancel: threading.Event = None) -> SandboxResult:
  """Runs `code` with cwd = files_dir under the limits of `sandbox_cfg` (config.envs.sandbox).

  Output beyond `output_chars` characters (each of stdout, stderr) is cut. Setting `cancel`
  kills the run (status "cancelled"), e.g. when the caller's own time limit has passed.
  """
  files_dir = os.path.realpath(files_dir)
  use_ns = bool(sandbox_cfg.namespaces) and _namespaces_work()
  iso = isolation(sandbox_cfg)
  lim = sandbox_cfg

  def preexec():
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (int(lim.cpu_s), int(lim.cpu_s) + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb * mb, lim.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_size_mb * mb, lim.file_size_mb * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim.open_files, lim.open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim.max_processes, lim.max_processes))

  cmd = ([*_UNSHARE] if use_ns else []) + [sys.executable, "-I", "-B", "-c", _BOOT, files_dir,
                                           "1" if use_ns else "0"]
  env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
  t0 = time.monotonic()
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
       tempfile.TemporaryFile() as inp:
    inp.write(code.encode())
    inp.seek(0)
    proc = subprocess.Popen(cmd, stdin=inp, stdout=out, stderr=err, cwd=files_dir, env=env,
                            start_new_session=True, preexec_fn=preexec)
    killed_for = None
    # unshare + boot + worker are 3 processes of the tree; count only what the code started.
    if use_ns and os.path.exists(f"/proc/{proc.pid}/task/{proc.pid}/children"):
      count = lambda pid: _count_tree(pid, lim.max_processes + 3) - 3  # noqa: E731
    else:
      count = _count_session
    deadline = t0 + lim.wall_s
    polls = 0
    while True:
      try:
        # Short first waits: most runs end within a few hundred milliseconds.
        proc.wait(timeout=0.02 if polls < 10 else 0.05)
        break
      except subprocess.TimeoutExpired:
        polls += 1
      if cancel is not None and cancel.is_set():
        killed_for = "cancelled"
      elif time.monotonic() > deadline:
        killed_for = "timeout"
      elif polls % 2 == 0 and count(proc.pid) > lim.max_processes:
        killed_for = "process_limit"
      if killed_for:
        _kill_session(proc.pid)
        proc.wait()
        break
    # Orphans of a finished run (e.g. background children) never outlive it.
    _kill_session(proc.pid)
    wall = time.monotonic() - t0
    out.seek(0)
    err.seek(0)
    stdout = out.read(output_chars * 4).decode("utf-8", "replace")[:output_chars]
    stderr = err.read(output_chars * 4).decode("utf-8", "replace")[:output_chars]
  rc = proc.returncode
  if rc < 0:
    rc = 128 - rc  # killed by signal -rc (no namespace wrapper in between)
  if killed_for:
    status = killed_for
    rc = -9
  elif rc == 0:
    status = "ok"
  elif rc in (128 + signal.SIGXCPU, 128 + signal.SIGKILL) and wall < lim.wall_s:
    status = "cpu_limit" if rc == 128 + signal.SIGXCPU or _cpu_exhausted(stderr) else "memory_limit"
  elif "MemoryError" in stderr or "Cannot allocate memory" in stderr:
    status = "memory_limit"
  elif "File too large" in stderr:
    status = "file_size_limit"
  elif "Resource temporarily unavailable" in stderr and "fork" in stderr:
    status = "process_limit"
  elif "write outside the world refused" in stderr or "Read-only file system" in stderr:
    status = "write_blocked"
  elif _NET_RE.search(stderr):
    status = "network_blocked"
  else:
    status = "error"
  return SandboxResult(status=status, exit_code=rc, stdout=stdout, stderr=stderr, wall_s=wall,
                       isolation=iso)


def _cpu_exhausted(stderr: str) -> bool:
  del stderr
  return True  # a SIGKILL inside the wall limit comes from the CPU hard limit
