"""Config values that follow other config values until they are set.

A value derived from another key (the rollout engine's `max_len` from `train.max_context`, the
kept turns from prompts x samples, a model field from `model.preset`) is an ml_collections
FieldReference to its source, not a copy taken when the config file ran: an override of the
source -- a later line of a config file, `--config.train.max_context=4096`, a sweep's job --
reaches it. Setting the derived key itself replaces the reference by the value set (that is what
`FieldReference.set` does), so an explicit override of it wins in any order, and its source is
left as it was.

The references survive what configs go through here: command-line overrides on a locked config
(launch.py), `copy.deepcopy` (a sweep's dry run), pickling (module-level functions only, no
lambdas), `to_dict()` and `copy_and_resolve_references()` (which give the resolved values).
"""
import collections
import functools
import operator

from ml_collections import config_dict

from models import presets

# The `op` a FieldReference applies when read: fn(own value, *resolved args). ml_collections
# reads only these two attributes; a module-level namedtuple keeps the reference picklable.
_Op = collections.namedtuple("_Op", ["fn", "args"])


def follows(node: config_dict.ConfigDict, key: str) -> config_dict.FieldReference:
  """A value equal to `node[key]` (read when used) until it is set itself.

  Unlike `node.get_ref(key)`, which is the source's own reference (setting the copy would set
  the source too), setting this replaces only the copy.
  """
  return config_dict.FieldReference(node.get_ref(key))


def product(node: config_dict.ConfigDict, *keys: str) -> config_dict.FieldReference:
  """The product of `node[k]` for k in keys, read when used, until it is set itself."""
  refs = [node.get_ref(k) for k in keys]
  return functools.reduce(operator.mul, refs[1:], refs[0])


def preset_defaults(model: config_dict.ConfigDict) -> config_dict.ConfigDict:
  """Links every field a preset names (models/presets.py) to `model.preset`, in place.

  Such a field reads the named preset's value while it is not set, and its own value (the one
  it had here) when `model.preset` is "". Setting the field -- in a config file, on the command
  line, by a sweep -- makes it keep that value whatever the preset; setting `model.preset`
  changes every linked field that was not set. Returns `model`.
  """
  name = model.get_ref("preset")
  for key in presets.FIELDS:
    value = model[key]
    model[key] = config_dict.FieldReference(
        value, field_type=type(value), op=_Op(functools.partial(presets.default, key), [name]))
  return model
