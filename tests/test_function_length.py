"""Every function in models/, envs/ and rl/ is short enough to read whole: at most 80 lines,
unless a `# long:` comment on its `def` line or the line above says why. (benchmarks/ and
scripts/ may keep long `main`s.)"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("models", "envs", "rl")
MAX_LINES = 80


def _functions(path):
  with open(path, encoding="utf-8") as f:
    src = f.read()
  lines = src.splitlines()
  for node in ast.walk(ast.parse(src, path)):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      first = min([node.lineno] + [d.lineno for d in node.decorator_list])
      reason = any("# long:" in lines[i - 1] for i in (first - 1, first, node.lineno) if i >= 1)
      yield node.name, node.lineno, node.end_lineno - first + 1, reason


def test_no_function_in_the_packages_is_longer_than_80_lines_without_a_stated_reason():
  too_long = []
  for dirpath, _, files in sorted(w for top in PACKAGES for w in os.walk(os.path.join(ROOT, top))):
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        for fn, line, n, reason in _functions(path):
          if n > MAX_LINES and not reason:
            too_long.append(f"{os.path.relpath(path, ROOT)}:{line} {fn} ({n} lines)")
  assert not too_long, ("functions over 80 lines with no `# long:` comment saying why: "
                        + ", ".join(too_long))
