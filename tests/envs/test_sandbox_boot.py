"""envs/sandbox_boot.py, the sandbox's boot program, imported: it runs nothing then, and its
copying of the world's files in and back (the escape attempts are in tests/envs/test_sandbox.py,
which runs it as the sandbox does)."""
import os

from envs import sandbox
from envs import sandbox_boot


def test_the_sandbox_runs_this_file_as_its_boot_program():
  with open(sandbox_boot.__file__, encoding="utf-8") as f:
    assert sandbox._BOOT == f.read()


def test_copy_in_and_back_carry_files_and_folders_and_drop_links_made_inside(tmp_path):
  world, workspace = tmp_path / "world", tmp_path / "workspace"
  (world / "files").mkdir(parents=True)
  (world / "files" / "a.txt").write_text("a")
  (world / "gone.txt").write_text("x")
  os.symlink("files/a.txt", world / "kept_link")
  workspace.mkdir()
  sandbox_boot.copy_in(str(world), str(workspace))
  assert (workspace / "files" / "a.txt").read_text() == "a"
  assert os.readlink(workspace / "kept_link") == "files/a.txt"

  (workspace / "files" / "a.txt").write_text("changed")
  (workspace / "new").mkdir()
  (workspace / "new" / "b.txt").write_text("b")
  (workspace / "gone.txt").unlink()
  os.symlink("/etc/passwd", workspace / "made_inside")
  sandbox_boot.copy_back(str(workspace), str(world))
  assert (world / "files" / "a.txt").read_text() == "changed"
  assert (world / "new" / "b.txt").read_text() == "b"
  assert not (world / "gone.txt").exists()
  assert not os.path.lexists(world / "made_inside")
  assert os.readlink(world / "kept_link") == "files/a.txt"
