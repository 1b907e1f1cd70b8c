"""Confined code execution: code run through run_python and run_shell sees its workspace and
nothing else (each escape attempt is blocked and classified), limits stop runaway code, the
document libraries work, a machine without confinement refuses code, the gateway survives."""
import os
import socket
import sys
import threading
import time
import uuid

import docx
import ml_collections
import openpyxl
import pptx
import pytest

from configs import base
from envs import sandbox
from envs import worlds
from envs.apps import gateway as gateway_lib
from envs.apps import worldstate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Secrets the code must never print: the project's source, another world, a planted file, the
# parent's environment, a loopback service.
SOURCE = os.path.join(ROOT, "envs", "sandbox.py")
SOURCE_LINE = '"""Confined code execution for the code_execution app and the shell harness.'


@pytest.fixture(scope="module")
def cfg():
  c = base.get_config().envs
  c.sandbox.cpu_s = 2
  c.sandbox.wall_s = 4.0
  c.sandbox.memory_mb = 512
  c.sandbox.max_processes = 16
  c.sandbox.file_size_mb = 4
  c.sandbox.workspace_mb = 16
  c.sandbox.tmp_mb = 8
  c.tool_time_limit_s = 15.0
  return c


@pytest.fixture()
def files_dir(tmp_path):
  d = tmp_path / "world" / "files"
  d.mkdir(parents=True)
  (d / "data.txt").write_text("42\n")
  return str(d)


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
  """Another world's file, a file planted in the host's /tmp, an environment variable and a
  service on 127.0.0.1, each holding a secret."""
  other = tmp_path_factory.mktemp("other_world") / "files"
  other.mkdir()
  (other / "answers.txt").write_text("OTHER-WORLD-SECRET")
  planted = os.path.join("/tmp", f"planted-{uuid.uuid4().hex}.txt")
  with open(planted, "w") as f:
    f.write("PLANTED-SECRET")
  os.environ["SANDBOX_CANARY"] = "ENV-SECRET"
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen()
  stop = threading.Event()

  def serve():
    server.settimeout(0.2)
    while not stop.is_set():
      try:
        conn, _ = server.accept()
      except OSError:
        continue
      conn.sendall(b"LOOPBACK-SECRET")
      conn.close()

  threading.Thread(target=serve, daemon=True).start()
  yield dict(other=str(other / "answers.txt"), planted=planted, port=server.getsockname()[1])
  stop.set()
  server.close()
  os.environ.pop("SANDBOX_CANARY")
  os.remove(planted)


# ... and this process's command line, which a host /proc would show.
with open("/proc/self/cmdline", "rb") as _f:
  _OWN_CMDLINE = _f.read().replace(b"\0", b" ").decode().strip()
_LEAKS = ("OTHER-WORLD-SECRET", "PLANTED-SECRET", "ENV-SECRET", "LOOPBACK-SECRET", SOURCE_LINE,
          _OWN_CMDLINE)


def _attempts(s):
  """(name, language, code, statuses it may end with): each tries to read or reach what is not
  its workspace, or to break a limit."""
  port, planted, other = s["port"], s["planted"], s["other"]
  return [
      ("project source", "python", f"print(open({SOURCE!r}).read())", {"error"}),
      ("project source", "shell", f"cat {SOURCE}", {"error"}),
      ("import the project", "python", "import envs.sandbox", {"error"}),
      ("import the project", "shell", f"cd {ROOT} 2>&1; python3 -c 'import envs'", {"error"}),
      ("another world", "python", f"print(open({other!r}).read())", {"error"}),
      # One walk of the whole root (~150k entries, the read-only system and Python included:
      # seconds on a loaded machine, hence WALK_LIMITS), every hit printed.
      ("another world by walking /", "shell",
       "hits=$(find / \\( -name 'answers.txt' -o -name 'manifest.json' \\) 2>/dev/null); "
       "echo \"$hits\" | xargs -r cat; case \"$hits\" in *answers.txt*) exit 1;; esac", {"ok"}),
      ("planted file in /tmp", "python", f"print(open({planted!r}).read())", {"error"}),
      ("planted file in /tmp", "shell", f"cat {planted}", {"error"}),
      ("a link planted in the world", "shell", "cat link_out", {"error"}),
      ("a link made inside", "python",
       f"import os; os.symlink({planted!r}, 'l'); print(open('l').read())", {"error"}),
      ("dot-dot paths", "python", f"print(open('../../../../../..' + {planted!r}).read())",
       {"error"}),
      ("dot-dot paths", "shell", f"cat ../../../../../..{SOURCE}", {"error"}),
      ("boot's root through /proc", "shell", f"cat /proc/1/root{planted}", {"error"}),
      # pid 1 of the code's pid namespace is the sandbox's own shell (boot is not there): its
      # environment is the sandbox's, readable, and no secret.
      ("the parent's environment", "python",
       "import os; print(dict(os.environ)); print(open('/proc/self/environ').read()); "
       "print(open('/proc/1/environ').read())", {"ok"}),
      ("the parent's environment", "shell", "env; cat /proc/*/environ", {"ok", "error"}),
      ("host processes", "shell", "cat /proc/*/cmdline | tr '\\0' ' '; "
       "test $(ls -d /proc/[0-9]* | wc -l) -le 6", {"ok"}),
      ("the loopback network", "python",
       f"import socket; print(socket.create_connection(('127.0.0.1', {port}), 2).recv(99))",
       {"network_blocked"}),
      ("the loopback network", "shell",
       f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\"",
       {"network_blocked"}),
      ("write outside", "python", "open('/usr/evil', 'w').write('x')", {"write_blocked"}),
      ("write outside", "shell", "echo x > /evil", {"write_blocked"}),
      ("fork bomb", "python", "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n"
       "    pass", {"process_limit"}),
      ("fork bomb", "shell", "f() { f | f & }; f; sleep 10", {"process_limit"}),
      ("memory bomb", "python", "x = bytearray(8 * 1024 ** 3)", {"memory_limit"}),
      ("memory bomb", "shell", "python3 -c 'x = bytearray(8 * 1024 ** 3)'", {"memory_limit"}),
      ("fill the disk", "python",
       "i = 0\nwhile True:\n  open(f'fill{i}', 'wb').write(b'0' * 3_000_000); i += 1",
       {"disk_limit"}),
      ("fill the disk", "shell",
       "i=0; while true; do head -c 3000000 /dev/zero > fill$i || exit 1; i=$((i+1)); done",
       {"disk_limit"}),
      ("fill /tmp", "shell", "for i in 1 2 3 4; do head -c 3000000 /dev/zero > /tmp/f$i || exit 1;"
       " done", {"disk_limit"}),
  ]


# The attempt that walks the whole root gets the time a walk takes (the others' limits stay tight).
WALK_LIMITS = dict(wall_s=30.0, cpu_s=20)


def _run(language, code, files_dir, cfg, limits=None):
  fn = sandbox.run_python if language == "python" else sandbox.run_shell
  box = cfg.sandbox
  if limits:
    box = ml_collections.ConfigDict(box.to_dict())
    box.update(limits)
  return fn(code, files_dir, box, 4000)


def test_confinement_is_in_effect_here(cfg):
  assert "own-root" in sandbox.isolation(cfg.sandbox), sandbox.isolation(cfg.sandbox)


def test_every_escape_attempt_is_blocked_and_classified(files_dir, cfg, secrets):
  os.symlink(secrets["planted"], os.path.join(files_dir, "link_out"))
  for name, language, code, statuses in _attempts(secrets):
    r = _run(language, code, files_dir, cfg, WALK_LIMITS if "walking /" in name else None)
    shown = r.stdout + r.stderr
    assert r.status in statuses, (name, language, r)
    for leak in _LEAKS:
      assert leak not in shown, (name, language, leak, shown[-2000:])
  # Nothing reached the host: no file outside, the planted one unchanged, the link as it was.
  assert not os.path.exists("/usr/evil") and not os.path.exists("/evil")
  assert open(secrets["planted"]).read() == "PLANTED-SECRET"
  assert os.readlink(os.path.join(files_dir, "link_out")) == secrets["planted"]


def test_the_workspace_is_the_worlds_files_and_changes_come_back(files_dir, cfg):
  r = _run("python", "import os; print(os.getcwd(), sorted(os.listdir('.')), open('data.txt').read())"
           "\nopen('out.txt', 'w').write('ok'); os.remove('data.txt'); os.mkdir('sub')\n"
           "open('sub/x.txt', 'w').write('x'); os.symlink('/etc/passwd', 'link')", files_dir, cfg)
  assert r.status == "ok" and r.stdout.split("\n")[0] == "/workspace ['data.txt'] 42", r
  assert sorted(os.listdir(files_dir)) == ["out.txt", "sub"]   # no link comes back
  assert open(os.path.join(files_dir, "sub", "x.txt")).read() == "x"
  r = _run("shell", "cat out.txt; echo; echo more >> out.txt; ls /; command -v python3",
           files_dir, cfg)
  assert r.status == "ok" and r.stdout.startswith("ok\n"), r
  assert sorted(r.stdout.split("\n")[1:-2]) == sorted(
      {"bin", "dev", "lib", "lib64", "opt", "proc", "sbin", "tmp", "usr", "workspace"} |
      {dst.strip("/").split("/")[0] for _, dst in sandbox._layout()["python"]})
  assert open(os.path.join(files_dir, "out.txt")).read() == "okmore\n"


# What the code reads of its process and mounts (Python: its own view; the shell: every
# process of its namespace), printed for the test to search.
_SELF_VIEW = """
import glob, os, sys
for p in ["/proc/self/mountinfo", "/proc/mounts", "/proc/self/mountstats", "/proc/self/maps",
          "/proc/self/environ"] + sorted(glob.glob("/proc/[0-9]*/cmdline")):
  print(p, open(p, "rb").read().decode("utf-8", "replace").replace(chr(0), " "))
print(os.readlink("/proc/self/exe"), os.readlink("/opt/bin/python3"), os.getcwd())
print(sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.path, sys.argv)
import openpyxl, docx, pptx, pypdf, lxml.etree, PIL.Image
print([m.__file__ for m in (openpyxl, docx, pptx, pypdf, lxml.etree, PIL.Image)])
print([m.__cached__ for m in (openpyxl, docx, pptx, pypdf)])
"""
# The document libraries' files, bytecode included, searched inside for the needles (the
# code reaches the worker through a pipe: no command line holds them).
_SEARCH = """
import os
needles = [n.encode() for n in {needles!r}]
for d, _, files in os.walk("/opt/python"):
  for f in files:
    data = open(os.path.join(d, f), "rb").read()
    for n in needles:
      if n in data:
        print("HIT", os.path.join(d, f), n)
print("searched")
"""


def test_no_host_path_of_the_project_its_venv_or_the_run_shows_inside(files_dir, cfg,
                                                                      tmp_path_factory):
  """Inside the root, /proc/self/mountinfo and /proc/mounts (read from Python and from the
  shell), every process's command line, the process's maps, executable and environment, the
  interpreter's paths and the document libraries' files (their bytecode included) name no host
  path of the project, its virtualenv, the interpreter's prefix, the world's files or the
  run's temporary folders; the interpreter and the libraries appear under /opt."""
  layout = sandbox._layout()
  host = {ROOT, os.path.realpath(sys.prefix), os.path.realpath(files_dir),
          str(tmp_path_factory.getbasetemp()), sandbox._root_dir(),
          os.path.dirname(next(iter(layout["bytecode"].values())))}
  if layout["python"] and layout["python"][0][1] == sandbox._PYTHON_ROOT:
    host.add(os.path.realpath(sys.base_prefix))
  assert not any(h.rstrip("/") in ("", "/tmp", "/usr") for h in host), host
  r = sandbox.run_python(_SELF_VIEW, files_dir, cfg.sandbox, 1_000_000)
  assert r.status == "ok", r
  assert "/proc/self/mountinfo" in r.stdout and "/opt/python/openpyxl" in r.stdout, r.stdout
  for h in host:
    assert h not in r.stdout + r.stderr, (h, r.stdout)
  r = sandbox.run_shell("cat /proc/self/mountinfo /proc/mounts; tr '\\0' ' ' < /proc/1/cmdline",
                        files_dir, cfg.sandbox, 1_000_000)
  assert r.status == "ok" and " / / " in r.stdout, r
  for h in host:
    assert h not in r.stdout + r.stderr, (h, r.stdout)
  r = sandbox.run_python(_SEARCH.format(needles=sorted(host)), files_dir, cfg.sandbox, 100_000)
  assert r.status == "ok" and r.stdout.strip() == "searched", r


def test_a_run_that_is_stopped_leaves_the_world_as_it_was(files_dir, cfg):
  r = _run("shell", "echo changed > data.txt; sleep 100", files_dir, cfg)
  assert r.status == "timeout", r
  assert open(os.path.join(files_dir, "data.txt")).read() == "42\n"


def test_office_files_are_read_and_written_with_the_document_libraries(files_dir, cfg):
  wb = openpyxl.Workbook()
  wb.active["A1"] = 7
  wb.save(os.path.join(files_dir, "book.xlsx"))
  d = docx.Document()
  d.add_paragraph("hello docx")
  d.save(os.path.join(files_dir, "note.docx"))
  p = pptx.Presentation()
  p.slides.add_slide(p.slide_layouts[5]).shapes.title.text = "hello pptx"
  p.save(os.path.join(files_dir, "deck.pptx"))
  code = """
import openpyxl, docx, pptx, pypdf, io
wb = openpyxl.load_workbook('book.xlsx'); print(wb.active['A1'].value)
wb.active['B1'] = 8; wb.save('book.xlsx')
print(docx.Document('note.docx').paragraphs[0].text)
print(pptx.Presentation('deck.pptx').slides[0].shapes.title.text)
w = pypdf.PdfWriter(); w.add_blank_page(72, 72); w.write('blank.pdf')
print(len(pypdf.PdfReader('blank.pdf').pages))
d = docx.Document(); d.add_paragraph('written inside'); d.save('new.docx')
"""
  r = _run("python", code, files_dir, cfg)
  assert r.status == "ok" and r.stdout.split() == ["7", "hello", "docx", "hello", "pptx", "1"], r
  assert openpyxl.load_workbook(os.path.join(files_dir, "book.xlsx")).active["B1"].value == 8
  assert docx.Document(os.path.join(files_dir, "new.docx")).paragraphs[0].text == "written inside"
  r = _run("shell", "python3 -c \"import openpyxl; print(openpyxl.load_workbook('book.xlsx')"
           ".active['B1'].value)\"", files_dir, cfg)
  assert r.status == "ok" and r.stdout.strip() == "8", r


def test_cpu_loop_is_stopped(files_dir, cfg):
  t = time.monotonic()
  r = _run("python", "while True: pass", files_dir, cfg)
  assert r.status in ("cpu_limit", "timeout"), r
  assert time.monotonic() - t < cfg.sandbox.wall_s + 3


def test_sleeping_code_hits_the_wall_clock_and_leaves_no_process(files_dir, cfg):
  r = _run("python", "import time, subprocess\nsubprocess.Popen(['sleep', '100'])\n"
           "time.sleep(100)", files_dir, cfg)
  assert r.status == "timeout", r
  time.sleep(0.2)
  assert "sleep 100" not in os.popen("ps -eo args").read()  # the whole group is gone


def test_file_size_limit(files_dir, cfg):
  r = _run("python", "open('big.bin', 'wb').write(b'0' * (5 * 1024 * 1024))", files_dir, cfg)
  assert r.status == "file_size_limit", r


def test_without_confinement_code_is_refused_unless_allowed(files_dir, cfg):
  c = base.get_config().envs
  c.sandbox.namespaces = False
  r = sandbox.run_python("print(1)", files_dir, c.sandbox, 100)
  assert r.status == "refused" and "allow_unconfined" in r.stderr and not r.stdout
  assert sandbox.isolation(c.sandbox).startswith("refused")
  c.sandbox.allow_unconfined = True
  with pytest.warns(RuntimeWarning, match="UNCONFINED"):
    sandbox._warned_unconfined = False
    r = sandbox.run_python("print(open('data.txt').read().strip())", files_dir, c.sandbox, 100)
  assert r.status == "ok" and r.stdout.strip() == "42"
  assert "UNCONFINED" in sandbox.isolation(c.sandbox)


def test_gateway_keeps_serving_after_attacks(cfg, tmp_path):
  spec = worlds.spec_for(cfg, "management_consulting", 5)
  worlds.generate_world(cfg, spec, str(tmp_path / "w"))
  inst = worldstate.WorldInstance(str(tmp_path / "w"), str(tmp_path / "work"))
  with gateway_lib.Gateway(inst.path, cfg) as gw:
    for code, status in (("import os\nwhile True: os.fork()", "process_limit"),
                         ("x = bytearray(8 * 1024 ** 3)", "memory_limit"),
                         ("open('/usr/evil_sandbox_test', 'w')", "write_blocked")):
      r = gw.call_tool("code_execution_run_python", {"code": code})
      assert not r.is_error and f"status: {status}" in r.text, r.text
    r = gw.call_tool("code_execution_run_python",
                     {"code": "print(sorted(__import__('os').listdir('.')))"})
    assert "status: ok" in r.text and "decks" in r.text
    assert not gw.call_tool("mail_list_contacts", {}).is_error
