"""Confined code execution for the code_execution app and the shell harness.

The code a policy writes is adversarial: it wants the answer key. A run sees one root made for
it and nothing of the machine it runs on:

  /workspace   a copy of the world's files (tmpfs, envs.sandbox.workspace_mb); the cwd. What the
               run leaves there (regular files and folders, not links) is copied back when it
               ends; a run that is stopped (time, processes) leaves the world as it was.
  /tmp         private tmpfs (envs.sandbox.tmp_mb)
  /bin /usr /lib*   the host's system files, read-only (a shell, coreutils, grep, sed, awk)
  /opt/python3 the interpreter's prefix (its own path when that is under /usr): the interpreter
               and its standard library, read-only; its site-packages hidden
  /opt/python  the document libraries only (openpyxl, pypdf, python-docx, python-pptx and what
               they import), read-only; /opt/bin/python3 is the interpreter
  /dev         null, zero, random, urandom;  /proc  a fresh one of the code's own pid namespace

and no project source, no other world, no task or rubric data, no home directory, no host
process, no parent environment, no network. Everything else of the root is read-only. No host
path of the project, its virtualenv or the run's temporary folders shows either: not in
/proc/self/mountinfo or /proc/mounts, nor in the interpreter's paths, the process's command
line, maps, executable or environment, nor in the document libraries' bytecode ("Host paths"
below).

One run = one process tree:
  parent (this module) -- Popen, own session (killpg-able), rlimits set before exec
    unshare --user --map-root-user --net --mount --pid --fork --kill-child
      boot (pid 1 of the namespaces, envs/sandbox_boot.py): builds the root on a tmpfs with read-only
      mounts, copies the world's files in, makes itself undumpable, forks into a new pid
      namespace
        init (pid 1 of that one): its own mount namespace with a fresh /proc of its pid
        namespace, pivot_root into the new root (the old one detached), no_new_privs, every
        capability dropped; then execs `/bin/sh -c '"$@"; exit $?'`, which runs
          worker: `python3 -s -` reading the code from a pipe, or `/bin/sh -c <command>`
      boot copies /workspace back into the world's files and exits with the worker's status.

Host paths. Boot lives on the host side (its command line, mount table and environment name
host folders), so the code runs in a pid namespace where boot is not, with a /proc of that
namespace only, as a fresh interpreter exec'd from the new root (a fork of boot would carry
boot's command line, sys.executable and modules). A bind mount shows its source's path in
/proc/self/mountinfo (the 4th field, the path inside the source's filesystem) whatever its
mount point, so a staging path would not hide it: the interpreter's prefix and the document
libraries are read-only overlay mounts instead, whose root is "/" and whose options name their
layers as /proc/self/fd/N (the descriptors boot had open while mounting). The interpreter's
prefix appears at /opt/python3 (libpython found through LD_LIBRARY_PATH, its runpath being the
host prefix). An installed library's bytecode embeds the host path it was compiled at, so an
overlay layer of bytecode compiled under /opt/python/<name> (once per user and machine,
`_bytecode_layers`) covers it. Where the kernel makes no overlay in a user namespace (before
5.11) the mounts fall back to binds, which show their host sources. What remains: the
interpreter's own files name its install prefix (runpath, sysconfig data, standard-library
bytecode), and /usr and /lib* are the host's system folders at their own paths.

Why our own namespaces rather than bubblewrap: `unshare` is in util-linux on every Linux
machine the project runs on, the mechanism is the same user+mount+pid+net namespaces bubblewrap
uses, and nothing outside the Python requirements has to be installed.

Limits and how they surface (SandboxResult.status):
  wall clock      -> parent kills the whole process group              "timeout"
  RLIMIT_CPU      -> SIGXCPU / SIGKILL                                 "cpu_limit"
  RLIMIT_AS       -> MemoryError or a kill                             "memory_limit"
  RLIMIT_FSIZE    -> EFBIG ("File too large")                          "file_size_limit"
  tmpfs sizes     -> ENOSPC ("No space left on device")                "disk_limit"
  process count   -> parent watchdog counts the tree, kills it         "process_limit"
  no network      -> empty network namespace: ENETUNREACH              "network_blocked"
  read-only root  -> EROFS                                             "write_blocked"
  no confinement  -> the run is not started                            "refused"
RLIMIT_NPROC is set too, but the kernel does not apply it to root, which is why a watchdog
counts processes. Fails closed: where the kernel makes no namespaces (or envs.sandbox.namespaces
is off) code is refused, unless envs.sandbox.allow_unconfined=True, which runs it with rlimits,
its own session and an audit hook refusing Python-level writes outside the world only, and says
so (`isolation()`, and a warning on the first run).
"""
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import platform
import py_compile
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

# The boot program, envs/sandbox_boot.py, runs as its text:
# `python -I -B -c <text> <files_dir> <confined 1|0> <python|shell> <layout json>`, inside the
# namespaces when confined; stdin = the code.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_boot.py"),
          encoding="utf-8") as _f:
  _BOOT = _f.read()

_UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork",
            "--kill-child"]
# pivot_root has no libc wrapper; its syscall number by machine.
_PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41, "arm64": 41, "ppc64le": 203, "s390x": 217}
# What the document tools of a world need (python-pptx: lxml, Pillow, XlsxWriter; openpyxl:
# et_xmlfile); their vendored shared libraries (`*.libs`) come along.
_DOCUMENT_LIBRARIES = ("openpyxl", "et_xmlfile", "pypdf", "docx", "pptx", "lxml", "PIL",
                       "xlsxwriter", "typing_extensions")
_SYSTEM = ("/bin", "/sbin", "/usr", "/lib", "/lib32", "/lib64", "/libx32")
# Where the interpreter's prefix appears in the root when it is not under a system folder.
_PYTHON_ROOT = "/opt/python3"


@dataclasses.dataclass
class SandboxResult:
  status: str          # ok | error | timeout | cpu_limit | memory_limit | file_size_limit |
                       # disk_limit | process_limit | network_blocked | write_blocked |
                       # cancelled | refused
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


def _under(path: str, top: str) -> bool:
  return path == top or path.startswith(top.rstrip("/") + "/")


@functools.lru_cache(maxsize=None)
def _layout() -> dict:
  """What the confined root is made of on this machine (see the module docstring)."""
  base = os.path.realpath(sys.base_prefix)
  interpreter = os.path.realpath(sys.executable)
  on_system = lambda p: any(_under(p, top) for top in _SYSTEM)  # noqa: E731

  def inside(p):  # a host path of the interpreter's files -> its path in the root
    return _PYTHON_ROOT + p[len(base):] if not on_system(base) and _under(p, base) else p

  python = [] if on_system(base) else [[base, _PYTHON_ROOT]]
  if not on_system(interpreter) and not _under(interpreter, base):
    python.append([interpreter, interpreter])  # outside its prefix: bound where it is
  hide = []
  for top in (base, "/usr", "/usr/local"):
    for lib in ("lib", "lib64"):
      d = os.path.join(top, lib)
      if os.path.isdir(d):
        for name in sorted(os.listdir(d)):
          if name.startswith("python"):
            for sub in ("site-packages", "dist-packages"):
              if os.path.isdir(os.path.join(d, name, sub)):
                hide.append(inside(os.path.realpath(os.path.join(d, name, sub))))
  libs = {}
  for name in _DOCUMENT_LIBRARIES:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
      continue
    path = os.path.dirname(spec.origin) if spec.submodule_search_locations else spec.origin
    libs[os.path.basename(path)] = path
    # A wheel's vendored shared libraries sit beside it as <distribution>.libs.
    for dist in (name.lower(), {"PIL": "pillow"}.get(name, "")):
      vendored = os.path.join(os.path.dirname(path), dist + ".libs")
      if dist and os.path.isdir(vendored):
        libs[dist + ".libs"] = vendored
  relocated = bool(python) and python[0][1] == _PYTHON_ROOT
  return dict(system=[p for p in _SYSTEM if os.path.lexists(p)], python=python,
              hide=sorted(set(hide)), libs=libs, bytecode=_bytecode_layers(libs),
              interpreter=inside(interpreter),
              library_path=_PYTHON_ROOT + "/lib" if relocated else "",
              pivot_root_nr=_PIVOT_ROOT_NR.get(platform.machine(), -1))


def _ours(path: str) -> bool:
  """Whether `path` is a folder (not a link) of this user that no one else may write to."""
  if os.path.islink(path) or not os.path.isdir(path):
    return False
  st = os.lstat(path)
  return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _bytecode_layers(libs: dict) -> dict:
  """{library name: a host folder of its bytecode compiled as at /opt/python/<name>}.

  An installed library's __pycache__ files embed the path they were compiled at (for the
  project's virtualenv, the project's path); laid over the library, these take their place,
  and tell the code nothing of the host. Made once per user, machine and library versions
  (under the temp folder; a stale file is only slower: Python checks each against its
  source). A folder of that name that is not this user's alone is not used."""
  tag = sys.implementation.cache_tag
  if tag is None:
    return {}
  stamp = [sys.version] + sorted([n, p, os.stat(p).st_mtime_ns] for n, p in libs.items())
  key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]
  top = os.path.join(tempfile.gettempdir(), f"sandbox-bytecode-{os.getuid()}-{key}")
  if not _ours(top):
    staging = tempfile.mkdtemp(prefix=".sandbox-bytecode-", dir=tempfile.gettempdir())
    for name, path in libs.items():
      layer = os.path.join(staging, name)
      os.makedirs(layer)
      sources = [("", path)] if not os.path.isdir(path) else [
          (os.path.relpath(os.path.join(d, f), path), os.path.join(d, f))
          for d, _, fs in os.walk(path) for f in fs if f.endswith(".py")]
      for rel, src in sources:
        # A one-file module's bytecode sits in /opt/python/__pycache__ (the layer's top).
        where = os.path.join(layer, os.path.dirname(rel), "__pycache__") if rel else layer
        stem = os.path.basename(rel or src)[:-3]
        try:
          py_compile.compile(src, cfile=os.path.join(where, f"{stem}.{tag}.pyc"),
                             dfile="/opt/python/" + (os.path.join(name, rel) if rel else name),
                             doraise=True)
        except py_compile.PyCompileError:
          continue  # not valid Python for this interpreter (never imported here either)
    try:
      os.rename(staging, top)
    except OSError:  # made meanwhile, by another process or another user
      pass
    if not _ours(top):
      top = staging  # the name is taken by someone else: this process's own copy
    elif os.path.isdir(staging):
      shutil.rmtree(staging, ignore_errors=True)
  return {name: os.path.join(top, name) for name in libs}


@functools.lru_cache(maxsize=None)
def _confinement_works() -> bool:
  """Whether a confined run starts here (user namespaces, mounts, pivot_root): probed once."""
  if shutil.which("unshare") is None or platform.machine() not in _PIVOT_ROOT_NR:
    return False
  with tempfile.TemporaryDirectory() as files:
    open(os.path.join(files, "probe.txt"), "w").close()
    try:
      p = subprocess.run(_command("python", files, True, _root_dir()),
                         input="import os; print(sorted(os.listdir('.')), os.getcwd())",
                         capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
      return False
  return p.returncode == 0 and p.stdout.strip() == "['probe.txt'] /workspace"


def _root_dir() -> str:
  """An empty host folder to mount the run's root on (it stays empty on the host)."""
  d = os.path.join(tempfile.gettempdir(), "sandbox-root")
  os.makedirs(d, exist_ok=True)
  return d


def _confined(sandbox_cfg) -> bool:
  return bool(sandbox_cfg.namespaces) and _confinement_works()


def isolation(sandbox_cfg) -> str:
  """The isolation runs get with these settings, as one line."""
  base = "rlimits(cpu,as,fsize,nofile,core)+session-kill+process-watchdog"
  if _confined(sandbox_cfg):
    return ("namespaces(user,net,mount,pid)+own-root(workspace,ro-system,ro-python,"
            "document-libraries,own-proc,private-tmp,no-host-paths)+caps-dropped+no-new-privs+"
            + base)
  if sandbox_cfg.allow_unconfined:
    return (base + "+write-audit-hook: UNCONFINED (no namespaces: code reads the whole machine, "
            "network open; envs.sandbox.allow_unconfined=True)")
  return ("refused: no confinement here (user namespaces unavailable or envs.sandbox.namespaces "
          "off); code execution is refused unless envs.sandbox.allow_unconfined=True")


def _command(kind: str, files_dir: str, confined: bool, root: str, workspace_mb: int = 8,
             tmp_mb: int = 8) -> list:
  layout = dict(_layout(), root=root, workspace_mb=int(workspace_mb), tmp_mb=int(tmp_mb))
  return ([*_UNSHARE] if confined else []) + [
      sys.executable, "-I", "-B", "-c", _BOOT, files_dir, "1" if confined else "0", kind,
      json.dumps(layout)]


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
    # A killed leader stays a zombie until it is reaped: it no longer runs anything.
    if len(fields) > 3 and int(fields[3]) == sid and fields[0] != b"Z":
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
  """Runs Python `code` in the confined root, cwd /workspace = a copy of `files_dir`, under the
  limits of `sandbox_cfg` (config.envs.sandbox); what it leaves in /workspace is copied back.

  Output beyond `output_chars` characters (each of stdout, stderr) is cut. Setting `cancel`
  kills the run (status "cancelled"), e.g. when the caller's own time limit has passed.
  """
  return _run("python", code, files_dir, sandbox_cfg, output_chars, cancel)


def run_shell(command: str, files_dir: str, sandbox_cfg, output_chars: int,
              cancel: threading.Event = None) -> SandboxResult:
  """Runs `/bin/sh -c command` (coreutils, grep, sed, awk, python3 with the document
  libraries) as `run_python` runs code: same root, limits, copy back and statuses."""
  return _run("shell", command, files_dir, sandbox_cfg, output_chars, cancel)


_warned_unconfined = False


def _run(kind, code, files_dir, sandbox_cfg, output_chars, cancel):
  global _warned_unconfined
  files_dir = os.path.realpath(files_dir)
  use_ns = _confined(sandbox_cfg)
  iso = isolation(sandbox_cfg)
  lim = sandbox_cfg
  if not use_ns and not lim.allow_unconfined:
    return SandboxResult(status="refused", exit_code=-1, stdout="", wall_s=0.0, isolation=iso,
                         stderr=f"code execution {iso}")
  if not use_ns and not _warned_unconfined:
    _warned_unconfined = True
    warnings.warn(f"sandbox: {iso}", RuntimeWarning, stacklevel=3)
  cmd = _command(kind, files_dir, use_ns, _root_dir(), lim.workspace_mb, lim.tmp_mb)
  env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
  t0 = time.monotonic()
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
       tempfile.TemporaryFile() as inp:
    inp.write(code.encode())
    inp.seek(0)
    proc = subprocess.Popen(cmd, stdin=inp, stdout=out, stderr=err, cwd=files_dir, env=env,
                            start_new_session=True, preexec_fn=_rlimits(lim))
    killed_for = _watch(proc, lim, use_ns, cancel, t0 + lim.wall_s)
    # Orphans of a finished run (e.g. background children) never outlive it.
    _kill_session(proc.pid)
    wall = time.monotonic() - t0
    out.seek(0)
    err.seek(0)
    stdout = out.read(output_chars * 4).decode("utf-8", "replace")[:output_chars]
    stderr = err.read(output_chars * 4).decode("utf-8", "replace")[:output_chars]
  status, rc = _status(proc.returncode, killed_for, stderr, wall, lim.wall_s)
  return SandboxResult(status=status, exit_code=rc, stdout=stdout, stderr=stderr, wall_s=wall,
                       isolation=iso)


def _rlimits(lim):
  """The child's rlimits, set between fork and exec."""
  def preexec():
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (int(lim.cpu_s), int(lim.cpu_s) + 1))
    resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb * mb, lim.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_size_mb * mb, lim.file_size_mb * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim.open_files, lim.open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim.max_processes, lim.max_processes))
  return preexec


def _watch(proc, lim, use_ns: bool, cancel, deadline: float):
  """Waits for the run; kills its session when it is cancelled, passes the wall clock or starts
  too many processes, and says which (None: it ended by itself)."""
  # unshare + boot + init + worker are 4 processes of the tree; count only what the code
  # started.
  if use_ns and os.path.exists(f"/proc/{proc.pid}/task/{proc.pid}/children"):
    count = lambda pid: _count_tree(pid, lim.max_processes + 4) - 4  # noqa: E731
  else:
    count = _count_session
  polls = 0
  while True:
    try:
      # Short first waits: most runs end within a few hundred milliseconds.
      proc.wait(timeout=0.02 if polls < 10 else 0.05)
      return None
    except subprocess.TimeoutExpired:
      polls += 1
    killed_for = None
    if cancel is not None and cancel.is_set():
      killed_for = "cancelled"
    elif time.monotonic() > deadline:
      killed_for = "timeout"
    elif polls % 2 == 0 and count(proc.pid) > lim.max_processes:
      killed_for = "process_limit"
    if killed_for:
      _kill_session(proc.pid)
      proc.wait()
      return killed_for


def _status(rc: int, killed_for, stderr: str, wall: float, wall_s: float) -> tuple[str, int]:
  """(SandboxResult.status, exit code) from how the run ended and what it wrote to stderr."""
  if rc < 0:
    rc = 128 - rc  # killed by signal -rc (no namespace wrapper in between)
  if killed_for:
    return killed_for, -9
  if rc == 0:
    status = "ok"
  elif rc in (128 + signal.SIGXCPU, 128 + signal.SIGKILL) and wall < wall_s:
    status = "cpu_limit" if rc == 128 + signal.SIGXCPU or _cpu_exhausted(stderr) else "memory_limit"
  elif "MemoryError" in stderr or "Cannot allocate memory" in stderr:
    status = "memory_limit"
  elif "File too large" in stderr:
    status = "file_size_limit"
  elif "No space left on device" in stderr:
    status = "disk_limit"
  elif "Resource temporarily unavailable" in stderr and "fork" in stderr:
    status = "process_limit"
  elif "write outside the world refused" in stderr or "Read-only file system" in stderr:
    status = "write_blocked"
  elif _NET_RE.search(stderr):
    status = "network_blocked"
  else:
    status = "error"
  return status, rc


def _cpu_exhausted(stderr: str) -> bool:
  del stderr
  return True  # a SIGKILL inside the wall limit comes from the CPU hard limit
