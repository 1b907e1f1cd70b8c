"""Working copies of a world: what an episode mutates, restored cheaply between episodes.

The rendered world under worlds_root stays pristine; each episode runs on a working copy.
`reset()` restores only what changed (files compared by size and mtime, copies keep the
pristine mtime), so a gateway process can serve episode after episode of the same world.
"""
import os
import shutil


def _scan(root: str):
  """(files {relpath: (size, mtime_ns)}, dirs {relpath}) under root, without following links."""
  files, dirs = {}, set()
  stack = [("", root)]
  while stack:
    rel, path = stack.pop()
    with os.scandir(path) as it:
      for e in it:
        r = rel + e.name
        if e.is_dir(follow_symlinks=False):
          dirs.add(r)
          stack.append((r + os.sep, e.path))
        else:
          st = e.stat(follow_symlinks=False)
          files[r] = (st.st_size, st.st_mtime_ns)
  return files, dirs


def _manifest(root: str) -> dict:
  return _scan(root)[0]


class WorldInstance:
  """A working copy of a pristine world directory.

  Attributes:
    pristine: the rendered world (read-only by convention; the "before" state of grading).
    path: the working copy (files/ + apps/) that tools and the sandbox act on.
  """

  def __init__(self, pristine: str, path: str):
    self.pristine = os.path.realpath(pristine)
    self.path = os.path.abspath(path)
    if os.path.exists(self.path):
      shutil.rmtree(self.path)
    shutil.copytree(self.pristine, self.path)
    self._base, self._dirs = _scan(self.pristine)
    self.input_files = {}

  def reset(self, input_files: dict = None):
    """Restores the pristine state, then writes this episode's input files.

    Args:
      input_files: {path relative to files/: text} placed before the episode starts.
    """
    cur, cur_dirs = _scan(self.path)
    # Directories the episode created go first, with everything in them.
    for d in sorted(cur_dirs - self._dirs, key=len):
      if os.path.lexists(os.path.join(self.path, d)):
        shutil.rmtree(os.path.join(self.path, d))
    for rel, sig in cur.items():
      if self._base.get(rel) != sig and os.path.lexists(os.path.join(self.path, rel)):
        os.remove(os.path.join(self.path, rel))
    for d in self._dirs - cur_dirs:
      os.makedirs(os.path.join(self.path, d), exist_ok=True)
    for rel, sig in self._base.items():
      if cur.get(rel) != sig:
        dst = os.path.join(self.path, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(os.path.join(self.pristine, rel), dst)
    self.input_files = dict(input_files or {})
    for rel, text in self.input_files.items():
      dst = os.path.join(self.path, "files", rel)
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      with open(dst, "w") as f:
        f.write(text)

  def snapshot(self, dest: str) -> str:
    """Copies the current state to dest (e.g. to grade later or to branch an episode)."""
    if os.path.exists(dest):
      shutil.rmtree(dest)
    shutil.copytree(self.path, dest)
    return dest

  def restore(self, snapshot_dir: str):
    """Makes the working copy equal to a snapshot taken with `snapshot`."""
    shutil.rmtree(self.path)
    shutil.copytree(snapshot_dir, self.path)

  def close(self):
    shutil.rmtree(self.path, ignore_errors=True)


def remove_stale_copies(root: str, prefix: str) -> None:
  """Removes the working copies `root/<prefix><pid>-...` whose process `pid` is gone (a killed
  agent process cannot clean up after itself); copies of this process and of live ones stay."""
  try:
    names = os.listdir(root)
  except OSError:
    return
  for n in names:
    if not n.startswith(prefix):
      continue
    pid = n[len(prefix):].split("-", 1)[0]
    if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
      p = os.path.join(root, n)
      if os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p, ignore_errors=True)
      else:
        try:
          os.remove(p)
        except OSError:
          pass
