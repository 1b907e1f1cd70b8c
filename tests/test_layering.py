"""The project's import layering, read from the source with `ast` (nothing is imported).

Layers, lowest first: `models` imports nothing of the project; `envs` imports `models` at
most; `rl` may import `envs` and `models`; `launch.py`, `benchmarks/` and `scripts/` sit on
top. `configs/` is a leaf that anything may import; it may itself import only `models`.

Every import counts, at the top of a file or inside a function, so a circle or an upward
import cannot hide behind a function-level import. An import inside a function body in
`models/`, `envs/` or `rl/` must carry `# lazy: <reason>` on its line or the line above (a
heavy dependency that a cheap path must not pay for, or an import that must follow setting
XLA_FLAGS); every other import belongs at the top of its file.
"""
import ast
import dataclasses
import functools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("models", "envs", "rl", "configs")
# Folders of scripts run by path: their own folder is sys.path[0], so `import bench_overrides`
# in benchmarks/ names benchmarks/bench_overrides.py.
SCRIPT_DIRS = ("benchmarks", "scripts")
TOP_FILES = ("launch.py",)

# What each layer may import of the project besides itself.
ALLOWED = {
    "models": set(),
    "configs": {"models"},
    "envs": {"models", "configs"},
    "rl": {"envs", "models", "configs"},
    "launch": {"rl", "envs", "models", "configs"},
    "benchmarks": {"rl", "envs", "models", "configs"},
    "scripts": {"rl", "envs", "models", "configs"},
}
LAZY_CHECKED = ("models", "envs", "rl")
LAZY_MARK = "lazy:"


@dataclasses.dataclass(frozen=True)
class Import:
  source: str        # importing module, e.g. "envs.harness.pool"
  target: str        # imported project module, e.g. "envs.harness.world"
  path: str          # importing file, relative to the repository root
  line: int


@dataclasses.dataclass
class Scan:
  modules: dict      # module name -> file, relative to the repository root
  imports: list      # Import, one per (statement, project module it names)
  missing: list      # "file:line: ..." for names of project modules that do not exist
  unmarked: list     # "file:line: ..." for function-level imports without a lazy mark


def _project_files() -> dict:
  """{module name: relative path} of every project .py file."""
  files = {}
  for top in PACKAGES + SCRIPT_DIRS:
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
      dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
      for name in sorted(filenames):
        if name.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, name), ROOT)
          parts = rel[:-len(".py")].split(os.sep)
          if parts[-1] == "__init__":
            parts = parts[:-1]
          files[".".join(parts)] = rel
  for name in TOP_FILES:
    if os.path.exists(os.path.join(ROOT, name)):
      files[name[:-len(".py")]] = name
  return files


def _layer(module: str) -> str:
  return module.split(".")[0]


def _top_level_names(tree) -> set:
  """Names a module defines at its top level (what `from package import name` can take)."""
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      for t in targets:
        names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
  return names


def _imported(node, source: str, is_package: bool, modules: dict) -> list:
  """[(project module, name taken from it or None)] of one import statement, each module as
  written (it may not exist): `import a.b` -> (a.b, None); `from a import b` -> (a.b, None)
  when a.b is a module, else (a, "b")."""
  layer = _layer(source)

  def absolute(name):
    if layer in SCRIPT_DIRS and f"{layer}.{name.split('.')[0]}" in modules:
      return f"{layer}.{name}"        # a sibling script module
    return name if name.split(".")[0] in PACKAGES + ("launch",) else None

  if isinstance(node, ast.Import):
    return [(m, None) for m in (absolute(a.name) for a in node.names) if m]
  if node.level:
    base = source.split(".")[:None if is_package else -1]
    base = base[:len(base) - (node.level - 1)]
    prefix = ".".join(base + ([node.module] if node.module else []))
  else:
    prefix = absolute(node.module)
    if prefix is None:
      return []
  out = []
  for alias in node.names:
    if alias.name != "*" and f"{prefix}.{alias.name}" in modules:
      out.append((f"{prefix}.{alias.name}", None))
    else:
      out.append((prefix, None if alias.name == "*" else alias.name))
  return out


def _walk(node, in_function=False):
  """(import node, inside a function?) for every import under `node`, in source order."""
  for child in ast.iter_child_nodes(node):
    if isinstance(child, (ast.Import, ast.ImportFrom)):
      yield child, in_function
    yield from _walk(child, in_function or isinstance(
        child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def _has_lazy_mark(lines, lineno) -> bool:
  for n in (lineno, lineno - 1):
    text = lines[n - 1] if 1 <= n <= len(lines) else ""
    if "#" in text and LAZY_MARK in text[text.index("#"):]:
      return True
  return False


@functools.cache
def _scan() -> Scan:
  modules = _project_files()
  trees, texts = {}, {}
  for module, path in modules.items():
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      texts[module] = f.read()
    trees[module] = ast.parse(texts[module], filename=path)
  defined = {m: _top_level_names(t) for m, t in trees.items()}
  scan = Scan(modules, [], [], [])
  for module, path in sorted(modules.items()):
    lines = texts[module].splitlines()
    for node, in_function in _walk(trees[module]):
      where = f"{path}:{node.lineno}: {ast.unparse(node)}"
      for target, name in _imported(node, module, path.endswith("__init__.py"), modules):
        if target not in modules:
          folder = os.path.isdir(os.path.join(ROOT, *target.split(".")))
          scan.missing.append(f"{where}  ({target} has no module {name!r})" if folder and name
                              else f"{where}  ({target} is no module of the project)")
          continue
        if name is not None and name not in defined[target]:
          scan.missing.append(f"{where}  ({target} has no module or top-level name {name!r})")
        if target != module:
          scan.imports.append(Import(module, target, path, node.lineno))
      if (in_function and _layer(module) in LAZY_CHECKED
          and not _has_lazy_mark(lines, node.lineno)):
        scan.unmarked.append(where)
  return scan


def _cycles(imports) -> list:
  """One cycle through each strongly connected component of more than one module."""
  graph = {}
  for imp in imports:
    graph.setdefault(imp.source, set()).add(imp.target)
    graph.setdefault(imp.target, set())
  where = {}
  for imp in imports:
    where.setdefault((imp.source, imp.target), f"{imp.path}:{imp.line}")

  # Tarjan's algorithm, iterative.
  index, low, on_stack, stack, components = {}, {}, set(), [], []
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      node, successors = work[-1]
      for w in successors:
        if w not in index:
          index[w] = low[w] = len(index)
          stack.append(w)
          on_stack.add(w)
          work.append((w, iter(sorted(graph[w]))))
          break
        if w in on_stack:
          low[node] = min(low[node], index[w])
      else:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          component = set()
          while True:
            w = stack.pop()
            on_stack.discard(w)
            component.add(w)
            if w == node:
              break
          if len(component) > 1:
            components.append(component)

  cycles = []
  for component in components:
    start = min(component)
    # Shortest way from `start` back to itself inside the component (breadth first).
    parents, frontier, last = {start: None}, [start], None
    while last is None:
      following = []
      for node in frontier:
        if start in graph[node]:
          last = node
          break
        for w in sorted(graph[node] & component):
          if w not in parents:
            parents[w] = node
            following.append(w)
      frontier = following
    path = [last]
    while parents[path[-1]] is not None:
      path.append(parents[path[-1]])
    path = path[::-1] + [start]
    hops = start + "".join(f" --[{where[(a, b)]}]--> {b}" for a, b in zip(path, path[1:]))
    cycles.append(f"circle among {sorted(component)}: {hops}")
  return sorted(cycles)


def test_no_import_circles():
  cycles = _cycles(_scan().imports)
  assert not cycles, "import circles among project modules:\n" + "\n".join(cycles)


def test_no_upward_imports():
  upward = [f"{imp.path}:{imp.line}: {imp.source} imports {imp.target} "
            f"({_layer(imp.source)} may import only {sorted(ALLOWED[_layer(imp.source)])})"
            for imp in _scan().imports
            if _layer(imp.target) != _layer(imp.source)
            and _layer(imp.target) not in ALLOWED[_layer(imp.source)]]
  assert not upward, "upward imports:\n" + "\n".join(upward)


def test_function_level_imports_are_marked_lazy():
  unmarked = _scan().unmarked
  assert not unmarked, (
      f"imports inside a function in {', '.join(LAZY_CHECKED)} without a "
      f"'# {LAZY_MARK} <reason>' comment on the line or the line above (move them to the "
      "top of the file, or say why they must stay lazy):\n" + "\n".join(unmarked))


def test_imports_of_the_project_name_modules_that_exist():
  """After a module moves, an importer left behind fails here (and not only when run)."""
  missing = _scan().missing
  assert not missing, "imports of project modules or names that do not exist:\n" + "\n".join(
      missing)


def test_scan_sees_the_project():
  """The scan finds the packages and resolves imports: the other tests cannot pass on an
  empty graph."""
  scan = _scan()
  for module in ("models.qwen3_5", "envs.eval_summary", "rl.reductions", "configs.base", "launch"):
    assert module in scan.modules, f"{module} not found by the layering scan"
  assert any(i.source == "models.qwen3_5" and i.target == "models.config"
             for i in scan.imports), "the scan missed models.qwen3_5 importing models.config"
