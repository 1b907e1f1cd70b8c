"""The sandbox's boot program (envs/sandbox.py): pid 1 of the run's namespaces.

envs/sandbox.py reads this file and runs its text as
`python -I -B -c <this file's text> <files_dir> <confined 1|0> <python|shell> <layout json>`,
inside the namespaces when confined, with the code on stdin; the text on the command line names
no host path. It imports only the standard library. Confined, it builds the run's root on a
tmpfs, copies the world's files in, forks the code into a pid namespace of its own behind a
pivot_root, and copies /workspace back when the code ends; unconfined, it forks the code under
an audit hook refusing Python-level writes outside the world. It exits with the code's status.
Imported (tests), it runs nothing.
"""
import ctypes
import json
import os
import shutil
import sys
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE, MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 16384, 1 << 18, 1024, 2048, 1 << 21
libc = ctypes.CDLL(None, use_errno=True)


def fail(what):
  sys.stderr.write("sandbox: %s failed: %s\n" % (what, os.strerror(ctypes.get_errno())))
  os._exit(97)


def mount(src, dst, fstype, flags, data=None):
  enc = lambda x: None if x is None else x.encode()
  if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
    fail("mount %s" % dst)


def bind_ro(src, dst):
  # A bind is read-only after a remount that keeps the flags the kernel locked on the source.
  if os.path.isdir(src):
    os.makedirs(dst, exist_ok=True)
  else:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    open(dst, "a").close()
  mount(src, dst, None, MS_BIND)
  st, keep = os.statvfs(src).f_flag, MS_NOSUID
  for bit, flag in ((4, MS_NODEV), (8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME),
                    (4096, MS_RELATIME)):
    keep |= flag if st & bit else 0
  mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def overlay_ro(layers, dst, root):
  # A read-only overlay of host folders `layers` (the first on top) at dst: its root in
  # mountinfo is "/", and its options name the layers by descriptor, not by host path. An
  # overlay without an upper layer takes two layers or more: the last is the root's /proc,
  # empty (the code's own procfs is mounted over it later). Without overlays in a user
  # namespace (kernels before 5.11) the bottom layer is bound instead, showing its path.
  os.makedirs(dst, exist_ok=True)
  fds = [os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in layers + [root + "/proc"]]
  try:
    data = "lowerdir=" + ":".join("/proc/self/fd/%d" % fd for fd in fds)
    ok = libc.mount(b"overlay", dst.encode(), b"overlay", MS_RDONLY | MS_NOSUID | MS_NODEV,
                    data.encode()) == 0
  finally:
    for fd in fds:
      os.close(fd)
  if not ok:
    bind_ro(layers[-1], dst)


def copy_in(src, dst):
  for name in os.listdir(src):
    s, d = os.path.join(src, name), os.path.join(dst, name)
    if os.path.islink(s):
      os.symlink(os.readlink(s), d)
    elif os.path.isdir(s):
      os.mkdir(d)
      copy_in(s, d)
    elif os.path.isfile(s):
      shutil.copy2(s, d)


def copy_back(src, dst):
  # Regular files and folders only: a link or device made inside never reaches the world.
  keep = set()
  for name in os.listdir(src):
    s, d = os.path.join(src, name), os.path.join(dst, name)
    if os.path.islink(s):
      if os.path.islink(d):
        keep.add(name)  # a link the world had, left as it was
      continue
    if os.path.isdir(s):
      if os.path.lexists(d) and not os.path.isdir(d) or os.path.islink(d):
        os.remove(d)
      os.makedirs(d, exist_ok=True)
      copy_back(s, d)
    elif os.path.isfile(s):
      if os.path.isdir(d) and not os.path.islink(d):
        shutil.rmtree(d)
      a = os.stat(s)
      b = os.lstat(d) if os.path.lexists(d) else None
      if b is None or (a.st_size, a.st_mtime_ns) != (b.st_size, b.st_mtime_ns):
        if b is not None:
          os.remove(d)
        shutil.copy2(s, d)
    else:
      continue
    keep.add(name)
  for name in set(os.listdir(dst)) - keep:
    d = os.path.join(dst, name)
    shutil.rmtree(d) if os.path.isdir(d) and not os.path.islink(d) else os.remove(d)


def build_root(root, layout, files):
  mount(None, "/", None, MS_REC | MS_PRIVATE)
  mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
  os.makedirs(root + "/proc")  # empty: overlay_ro's bottom layer, and the code's procfs later
  for top in layout["system"]:
    if os.path.islink(top):
      os.symlink(os.readlink(top), root + top)
    elif os.path.isdir(top):
      bind_ro(top, root + top)
  for src, dst in layout["python"]:
    if src != dst:
      overlay_ro([src], root + dst, root)
    elif not os.path.exists(root + dst):
      bind_ro(src, root + dst)
  for path in layout["hide"]:
    if os.path.isdir(root + path):
      mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
  os.makedirs(root + "/opt/python/__pycache__")
  for name, path in layout["libs"].items():
    bytecode = layout["bytecode"].get(name)
    if os.path.isdir(path):
      overlay_ro(([bytecode] if bytecode else []) + [path], root + "/opt/python/" + name, root)
    else:  # a one-file module: copied, with its bytecode
      shutil.copy2(path, root + "/opt/python/" + name)
      if bytecode:
        for pyc in os.listdir(bytecode):
          shutil.copy2(os.path.join(bytecode, pyc), root + "/opt/python/__pycache__/" + pyc)
  os.makedirs(root + "/opt/bin")
  for name in ("python3", "python"):
    os.symlink(layout["interpreter"], root + "/opt/bin/" + name)
  os.makedirs(root + "/dev")
  for dev in ("null", "zero", "random", "urandom"):
    open(root + "/dev/" + dev, "w").close()
    mount("/dev/" + dev, root + "/dev/" + dev, None, MS_BIND)
  for i, name in enumerate(("stdin", "stdout", "stderr")):
    os.symlink("/proc/self/fd/%d" % i, root + "/dev/" + name)
  os.symlink("/proc/self/fd", root + "/dev/fd")
  for path, mb, mode in (("/tmp", layout["tmp_mb"], "1777"),
                         ("/workspace", layout["workspace_mb"], "755")):
    os.makedirs(root + path)
    mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=%s" % (mb, mode))
  try:
    copy_in(files, root + "/workspace")
  except OSError as e:
    sys.stderr.write("sandbox: the world's files do not fit the workspace: %s\n" % e)
    os._exit(97)
  mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def enter_root(root, layout):
  # Own mount namespace, so that boot keeps the host's view to copy the workspace back. The
  # procfs is of this process's pid namespace (boot is not in it), mounted while the host's
  # /proc is still in the namespace (a user namespace mounts a procfs only where one is seen).
  if libc.unshare(0x00020000) != 0:
    fail("unshare(mount)")
  mount(None, "/", None, MS_REC | MS_PRIVATE)
  mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  os.chdir(root)
  if libc.syscall(layout["pivot_root_nr"], b".", b".") != 0:
    fail("pivot_root")
  if libc.umount2(b".", 2) != 0:  # MNT_DETACH: the old root is gone from this namespace
    fail("umount old root")
  os.chdir("/workspace")
  PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
  libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
  for cap in range(64):
    libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
  class Hdr(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
  class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]
  if libc.capset(ctypes.byref(Hdr(0x20080522, 0)), (Data * 2)()) != 0:
    fail("capset")


def audit_outside_writes(files):
  # Unconfined runs only: Python-level writes outside the world are refused (a shell is not).
  def inside(p):
    try:
      p = os.path.realpath(os.fsdecode(p) if not isinstance(p, int) else "/dev/fd/%d" % p)
    except Exception:
      return False
    return p == files or p.startswith(files + "/") or p.startswith("/dev/")
  def hook(event, args):
    if event == "open":
      path, mode, flags = args
      writing = (mode and any(c in str(mode) for c in "wax+")) or (
          flags and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
      if writing and path is not None and not isinstance(path, int) and not inside(path):
        raise PermissionError("sandbox: write outside the world refused: %s" % (path,))
    elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.replace", "os.chmod",
                   "os.chown", "os.truncate", "os.symlink", "os.link", "os.utime",
                   "shutil.rmtree"):
      for p in args[:2]:
        if isinstance(p, (str, bytes, os.PathLike)) and not inside(p):
          raise PermissionError("sandbox: write outside the world refused: %s" % (p,))
  sys.addaudithook(hook)


def run_code(kind, code, files, env):
  """The forked child: the code as the worker (exec'd by the root's shell when confined)."""
  os.environ.clear()
  os.environ.update(env)
  if kind == "shell":
    os.execve("/bin/sh", ["sh", "-c", code], env)
  audit_outside_writes(files)
  g = {"__name__": "__main__", "__builtins__": __builtins__}
  try:
    exec(compile(code, "<code>", "exec"), g)
  except SystemExit as e:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
  except BaseException:
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)


def main():
  files, confined, kind = os.path.realpath(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
  layout = json.loads(sys.argv[4])
  code = sys.stdin.read()
  root = layout["root"]
  if confined:
    build_root(root, layout, files)
    env = {"PATH": "/opt/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/workspace", "TMPDIR": "/tmp",
           "LANG": "C.UTF-8", "PYTHONPATH": "/opt/python", "PYTHONDONTWRITEBYTECODE": "1"}
    if layout["library_path"]:
      env["LD_LIBRARY_PATH"] = layout["library_path"]
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no other process reads boot's memory
    # The code in a pid namespace of its own: boot is not in it. Its pid 1 is a shell that waits
    # for the worker (signals and orphans behave as usual for the code); the code reaches a
    # Python worker through a pipe (no size limit, no trace in a command line).
    if libc.unshare(0x20000000) != 0:  # CLONE_NEWPID: boot's next child is its pid 1
      fail("unshare(pid)")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
      os.close(w)
      os.dup2(r, 0)
      os.close(r)
      enter_root(root, layout)
      worker = ["python3", "-s", "-"] if kind == "python" else ["sh", "-c", code]
      os.execve("/bin/sh", ["sh", "-c", '"$@"; exit $?', "sh"] + worker, env)
    os.close(r)
    try:
      with open(w, "wb") as pipe:
        if kind == "python":
          pipe.write(code.encode())
    except BrokenPipeError:  # the worker ended before reading it all
      pass
  else:
    os.chdir(files)
    env = {"PATH": "/usr/bin:/bin", "HOME": files, "TMPDIR": files, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1"}
    # Unconfined: a fork of this process runs the code, under an audit hook.
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no other process reads boot's memory
    pid = os.fork()
  if pid == 0:
    run_code(kind, code, files, env)
  _, status = os.waitpid(pid, 0)
  if confined:
    try:
      copy_back(root + "/workspace", files)
    except OSError as e:
      sys.stderr.write("sandbox: copying the workspace back failed: %s\n" % e)
  sys.stdout.flush()
  if os.WIFSIGNALED(status):
    os._exit(128 + os.WTERMSIG(status))
  os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
  main()
