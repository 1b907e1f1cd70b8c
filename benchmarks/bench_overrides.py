"""`key.sub=value` config overrides for the benchmark scripts (launch.py has ml_collections flags)."""


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
    node[leaf] = parse_value(value)
