"""Working copies of a world: what an episode mutates, restored cheaply between episodes.

The rendered world under worlds_root stays pristine; each episode runs on a working copy.
`reset()` restores only what changed (files compared by size and mtime, copies keep the
pristine mtime), so a gateway process can serve episode after episode of the same world.
"""
import os
import shutil


def _manifest(root: str) -> dict:
  out = {}
  for d, dirs, names in os.walk(root):
    dirs.sort()
    for n in names:
      p = os.path.join(d, n)
      st = os.stat(p)
      out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
  return out


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
    self._base = _manifest(self.pristine)
    self._dirs = {os.path.relpath(d, self.pristine) for d, _, _ in os.walk(self.pristine)}
    self.input_files = {}

  def reset(self, input_files: dict = None):
    """Restores the pristine state, then writes this episode's input files.

    Args:
      input_files: {path relative to files/: text} placed before the episode starts.
    """
    # Directories the episode created go first, with everything in them.
    for d, dirs, _ in os.walk(self.path):
      for n in list(dirs):
        if os.path.relpath(os.path.join(d, n), self.path) not in self._dirs:
          shutil.rmtree(os.path.join(d, n))
          dirs.remove(n)
    for rel in self._dirs:
      os.makedirs(os.path.join(self.path, rel), exist_ok=True)
    cur = _manifest(self.path)
    for rel, sig in cur.items():
      if self._base.get(rel) != sig:
        os.remove(os.path.join(self.path, rel))
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
