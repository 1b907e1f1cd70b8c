"""The Markdown documentation holds together: links resolve, anchors name headings.

Checked files: README.md, every .md under docs/, and every other tracked .md file (the package
READMEs). A relative link `[text](path)` or `[text](path#anchor)` must name a file or folder that
exists, relative to the linking file and inside the repository; an anchor into a .md file (or
`(#anchor)` within the same file) must be the GitHub slug of one of its headings. Links in code
(fenced blocks, inline code spans) and http(s) / mailto links are not checked.

Also: the design notes live in docs/design.md only (no file outside docs/ names another design
file), and README.md stays a front door of at most 16,000 bytes.
"""
import os
import re
import subprocess
import urllib.parse

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_BYTES = 16_000
# Spelled in two pieces so that this file does not name it itself.
_OLD_DESIGN_FILE = "DESIGN" + ".md"
_SKIP_DIRS = {".git", ".venv", "runs", "node_modules", "__pycache__", ".pytest_cache"}

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)*?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")   # http:, https:, mailto:, ...


def tracked_files() -> list[str]:
  """Repository-relative paths of the tracked files (a walk of the tree without git)."""
  try:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    paths = [p for p in out.stdout.decode("utf-8").split("\0") if p]
  except (OSError, subprocess.CalledProcessError):
    paths = []
    for d, dirs, files in os.walk(ROOT):
      dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]
      paths += [os.path.relpath(os.path.join(d, f), ROOT) for f in files]
  return sorted(p for p in paths if os.path.isfile(os.path.join(ROOT, p)))


def markdown_files() -> list[str]:
  """README.md, every .md under docs/ (tracked or not yet), and the other tracked .md files."""
  found = {p for p in tracked_files() if p.endswith(".md")}
  if os.path.isfile(os.path.join(ROOT, "README.md")):
    found.add("README.md")
  for d, dirs, files in os.walk(os.path.join(ROOT, "docs")):
    dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]
    found |= {os.path.relpath(os.path.join(d, f), ROOT) for f in files if f.endswith(".md")}
  return sorted(p.replace(os.sep, "/") for p in found)


def prose_lines(text: str):
  """(line number, line) outside fenced code blocks."""
  fenced = False
  for n, line in enumerate(text.splitlines(), 1):
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if not fenced:
      yield n, line


def github_slug(heading: str) -> str:
  """The anchor GitHub gives a heading: its text (links and emphasis reduced to their words),
  lowercased, punctuation other than '-' and '_' dropped, spaces turned into '-'."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # [words](url) -> words
  text = re.sub(r"<[^>]+>", "", text)                       # inline HTML tags
  text = text.strip().lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def heading_anchors(path: str) -> set[str]:
  """Every anchor of a .md file's headings, duplicates numbered as GitHub numbers them."""
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    text = f.read()
  seen: dict[str, int] = {}
  anchors = set()
  for _, line in prose_lines(text):
    m = _HEADING.match(line)
    if not m:
      continue
    slug = github_slug(m.group(2))
    if slug in seen:
      seen[slug] += 1
      anchors.add(f"{slug}-{seen[slug]}")
    else:
      seen[slug] = 0
      anchors.add(slug)
  return anchors


def relative_links(path: str):
  """(line number, target) of every relative link in a .md file's prose."""
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    text = f.read()
  for n, line in prose_lines(text):
    for m in _LINK.finditer(_INLINE_CODE.sub("", line)):
      target = m.group(1)
      if not _EXTERNAL.match(target):
        yield n, target


def resolve(path: str, target: str) -> tuple[str, str]:
  """(repository-relative file or folder, anchor) that `target` in `path` points at."""
  where, _, anchor = target.partition("#")
  where = urllib.parse.unquote(where)
  if not where:
    return path, anchor
  joined = os.path.normpath(os.path.join(os.path.dirname(path), where))
  return joined.replace(os.sep, "/"), anchor


MARKDOWN = markdown_files()


def test_the_checked_files_include_the_readme_the_docs_and_the_package_readmes():
  assert "README.md" in MARKDOWN
  assert any(p.startswith("docs/") for p in MARKDOWN)
  for p in ("envs/README.md", "envs/harness/README.md", "rl/rollout/README.md"):
    if os.path.isfile(os.path.join(ROOT, p)):
      assert p in MARKDOWN


@pytest.mark.parametrize("path", MARKDOWN)
def test_every_relative_link_resolves_to_a_file_or_folder_in_the_repository(path):
  broken = []
  for n, target in relative_links(path):
    where, _ = resolve(path, target)
    if where == ".." or where.startswith("../") or os.path.isabs(where):
      broken.append(f"{path}:{n}: {target} points outside the repository")
    elif not os.path.exists(os.path.join(ROOT, where)):
      broken.append(f"{path}:{n}: {target} ({where} does not exist)")
  assert not broken, "\n".join(broken)


@pytest.mark.parametrize("path", MARKDOWN)
def test_every_anchor_names_a_heading_of_the_linked_page(path):
  broken = []
  for n, target in relative_links(path):
    where, anchor = resolve(path, target)
    if not anchor or not where.endswith(".md") or not os.path.isfile(os.path.join(ROOT, where)):
      continue
    anchors = heading_anchors(where)
    if anchor not in anchors:
      broken.append(f"{path}:{n}: #{anchor} is no heading of {where} "
                    f"(headings: {', '.join(sorted(anchors))})")
  assert not broken, "\n".join(broken)


@pytest.mark.parametrize("heading, slug", [
    ("Loss reductions", "loss-reductions"),
    ("Token-in, token-out rules", "token-in-token-out-rules"),
    ("`make run`", "make-run"),
    ("The engine's mesh", "the-engines-mesh"),
    ("What was extended in JetStream 0.2.2, and why (no JetStream source copied)",
     "what-was-extended-in-jetstream-022-and-why-no-jetstream-source-copied"),
    ("rl/rollout: JetStream serves the rollouts", "rlrollout-jetstream-serves-the-rollouts"),
    ("Why the tiny default trains only the output norm, at 1.0",
     "why-the-tiny-default-trains-only-the-output-norm-at-10"),
    ("keep_snake_case and [a link](x.md)", "keep_snake_case-and-a-link"),
])
def test_anchors_follow_githubs_heading_slugs(heading, slug):
  assert github_slug(heading) == slug


def test_no_file_outside_docs_names_an_old_design_file():
  """Design notes are cited as docs/design.md with a section, never as a file of another name."""
  needle = _OLD_DESIGN_FILE.encode()
  naming = []
  for p in tracked_files():
    if p.startswith("docs/"):
      continue
    with open(os.path.join(ROOT, p), "rb") as f:
      if needle in f.read():
        naming.append(p)
  assert not naming, f"these files name {_OLD_DESIGN_FILE}; cite docs/design.md instead: {naming}"


def test_readme_is_at_most_16000_bytes():
  size = os.path.getsize(os.path.join(ROOT, "README.md"))
  assert size <= README_MAX_BYTES, (
      f"README.md is {size} bytes; keep it a front door and move detail under docs/")
