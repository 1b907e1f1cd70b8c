"""`key.sub=value` config overrides for the benchmark scripts (launch.py has ml_collections flags),
and a config file's `get_config()` loaded by path."""
import importlib.util


def load_config_file(path: str):
  """`get_config()` of the config file at `path`, unlocked for the benchmark's own settings."""
  spec = importlib.util.spec_from_file_location("bench_config", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.unlock()
  return c


def parse_value(v: str):
  for cast in (int, float):
    try:
      return cast(v)
    except ValueError:
      pass
  return {"true": True, "false": False}.get(v.lower(), v)


def apply(config, pairs) -> None:
  """Sets each `a.b.c=value` of `pairs` on an unlocked ConfigDict; an unknown key is an error."""
  for kv in pairs:
    key, value = kv.split("=", 1)
    node = config
    *path, leaf = key.split(".")
    for part in path:
      node = node[part]
    if leaf not in node:
      raise KeyError(f"no config key {key!r}")
    if isinstance(node[leaf], tuple):   # `a.b=x,y`: a tuple field takes a comma-separated list
      node[leaf] = tuple(parse_value(v) for v in value.split(",") if v)
    else:
      node[leaf] = parse_value(value)
