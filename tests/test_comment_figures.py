"""Benchmark figures live in docs/results.md, each with its command and commit; a comment in the
code links there instead of quoting a ratio (`0.89x`, `~2.4x`), which drifts from the docs as
the code changes. Comments of models/, envs/, rl/, configs/ and launch.py are read with
`tokenize` (strings and docstrings are not comments)."""
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPS = ("models", "envs", "rl", "configs", "launch.py")
RATIO = re.compile(r"~?\b\d+\.\d+x\b|~\d+x\b")


def _python_files():
  for top in TOPS:
    path = os.path.join(ROOT, top)
    if path.endswith(".py"):
      yield top
      continue
    for dirpath, dirnames, files in os.walk(path):
      dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
      for name in sorted(files):
        if name.endswith(".py"):
          yield os.path.relpath(os.path.join(dirpath, name), ROOT)


def _ratios_in_comments(rel: str) -> list:
  with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
    tokens = tokenize.generate_tokens(io.StringIO(f.read()).readline)
    return [f"{rel}:{t.start[0]}: {t.string.strip()}" for t in tokens
            if t.type == tokenize.COMMENT and RATIO.search(t.string)]


def test_no_comment_quotes_a_benchmark_ratio():
  found = {rel: _ratios_in_comments(rel) for rel in _python_files()}
  quoted = [hit for hits in found.values() for hit in hits]
  assert not quoted, "ratios in comments (link docs/results.md instead):\n" + "\n".join(quoted)
