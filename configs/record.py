"""The resolved config as the record of a run: the model it builds and the keys in which it
differs from configs/base.py.

Values are read resolved: a derived key shows the value it follows to (configs/references.py),
a model field the preset value it defaults to unless it was set. launch.py prints `report()`
before every mode runs, and a sweep's dry run shows each job's resolved differences
(rl/sweep.py), so what a run resolved to is on its console before anything else happens.
"""
from configs import base
from models import config as model_config
from models import presets
from models import qwen3_5


def flat(config) -> dict:
  """Dotted key -> resolved value, for every leaf of `config` (a ConfigDict or a dict)."""
  out = {}

  def walk(prefix, node):
    for k, v in node.items():
      if isinstance(v, dict):
        walk(f"{prefix}{k}.", v)
      else:
        out[f"{prefix}{k}"] = v
  walk("", config.to_dict() if hasattr(config, "to_dict") else config)
  return out


_MISSING = object()


def differences(config, reference=None) -> list:
  """(key, value, reference's value) of every leaf whose resolved value differs between
  `config` and `reference` (default: configs/base.py `get_config()`), sorted by key; a key
  only one side has gets the string "(missing)" on the other."""
  mine = flat(config)
  theirs = flat(base.get_config() if reference is None else reference)
  out = []
  for k in sorted(set(mine) | set(theirs)):
    a, b = mine.get(k, _MISSING), theirs.get(k, _MISSING)
    if a is _MISSING or b is _MISSING or a != b or type(a) is not type(b):
      out.append((k, "(missing)" if a is _MISSING else a, "(missing)" if b is _MISSING else b))
  return out


def value_text(v) -> str:
  """A value as a `--config.key=value` flag writes it, so that ml_collections parses it back to
  `v`: strings unquoted at the top level, quoted in a tuple (unquoted, "(a,b)" would parse as the
  one string "(a,b)")."""
  if isinstance(v, (tuple, list)):
    return "(" + ",".join(repr(x) if isinstance(x, str) else value_text(x) for x in v) + (
        "," if len(v) == 1 else "") + ")"
  return str(v)


def _count(n: int) -> str:
  return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def model_line(config) -> str:
  """One line: the model `config.model` resolves to (depth, widths, heads, experts, vocab,
  parameters from shapes, dtypes) and the preset its fields default to, with the fields set
  over the preset."""
  m = qwen3_5.config_from_dict(config.model)
  full = sum(t == model_config.FULL for t in m.layer_types)
  parts = [f"{m.num_hidden_layers} layers ({m.num_hidden_layers - full} Gated DeltaNet, "
           f"{full} attention)", f"hidden {m.hidden_size}",
           f"attention {m.num_attention_heads} heads ({m.num_key_value_heads} KV) x {m.head_dim}",
           f"Gated DeltaNet {m.linear_num_key_heads}/{m.linear_num_value_heads} heads x "
           f"{m.linear_key_head_dim}/{m.linear_value_head_dim}"]
  if m.use_moe:
    parts.append(f"MoE {m.num_experts} experts (top {m.num_experts_per_tok}) x "
                 f"{m.moe_intermediate_size}" + (f" + shared {m.shared_expert_intermediate_size}"
                                                 if m.shared_expert_intermediate_size else ""))
  else:
    parts.append(f"dense MLP {m.intermediate_size}")
  parts.append(f"vocab {m.vocab_size}")
  counts = qwen3_5.count_params(m)
  line = (f"model: {', '.join(parts)}; {_count(counts['total'])} parameters "
          f"({_count(counts['active'])} active), {m.param_dtype} params, {m.dtype} compute")
  name = config.model.preset
  if not name:
    return line + "; no preset"
  fields = presets.preset(name)
  resolved = config.model.to_dict()
  changed = [f"{k}={value_text(resolved[k])}" for k in sorted(fields) if resolved[k] != fields[k]]
  return line + f"; preset {name}" + (f", set over it: {', '.join(changed)}" if changed else "")


def report(config) -> str:
  """The model line, then every key whose resolved value differs from configs/base.py, one a
  line: `key = value  (base: value)`."""
  diff = differences(config)
  lines = [model_line(config),
           f"config {config.name}: {len(diff)} keys differ from configs/base.py" +
           (":" if diff else "")]
  lines += [f"  {k} = {value_text(a)}  (base: {value_text(b)})" for k, a, b in diff]
  return "\n".join(lines)
