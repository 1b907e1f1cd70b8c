"""The policy's weights on disk: where a run starts from (a Hugging Face directory or the seeded
init), params saved with orbax (the SFT result), and the fingerprint that ties saved SFT params
to the start they were trained from."""
from __future__ import annotations

import hashlib
import os
import re

import jax

from models import hf_io
from models import qwen3_5
from models import sharding
from rl.checkpoint import Checkpointer


def init_params(config, shardings=None, path=None):
  """The policy's starting weights: config.train.init_from (a Hugging Face directory, e.g. a
  Qwen3.5 release or the tiny base checkpoint) or, when that is empty, the seeded random init.
  With `shardings` (a Sharding per param) a checkpoint is read straight into those shards, each
  process reading only its own devices' blocks. `path`: another Hugging Face directory to read
  instead of train.init_from (`--mode=serve --weights=DIR`)."""
  cfg = qwen3_5.config_from_dict(config.model)
  what = "config.train.init_from" if path is None else "weights"
  path = config.train.init_from if path is None else path
  if not path:
    return qwen3_5.init_params(cfg, jax.random.key(config.seed))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{what}={path!r} is not a directory")
  loaded_cfg = hf_io.read_config(path, dtype=cfg.jnp_param_dtype)
  def shapes(model_cfg):
    return jax.tree.map(lambda x: (x.shape, x.dtype), jax.eval_shape(
        lambda: qwen3_5.init_params(model_cfg, jax.random.key(0))))
  if shapes(loaded_cfg) != shapes(cfg):
    raise ValueError(f"{what}={path!r} holds a model of another shape than "
                     f"config.model (checkpoint: hidden {loaded_cfg.hidden_size}, "
                     f"{loaded_cfg.num_hidden_layers} layers, vocab {loaded_cfg.vocab_size})")
  return qwen3_5.load_hf(path, dtype=cfg.jnp_param_dtype, shardings=shardings)[1]


def save_params(directory: str, params, meta: dict, step: int = 0) -> None:
  """Params under `directory` as checkpoint `step`; only the newest one is kept."""
  ck = Checkpointer(directory, save_every=1, keep=1, async_save=False)
  ck.save(step, {"params": params}, meta, force=True)
  ck.close()


def load_params(directory: str, config, shardings=None):
  """The params saved by `save_params`, or None when there are none (`load_params_and_meta`
  without the meta)."""
  return load_params_and_meta(directory, config, shardings)[0]


def has_saved_params(directory: str) -> bool:
  """Whether `directory` holds a save of `save_params` (restorable or not); reads no weights."""
  if not os.path.isdir(directory):
    return False
  ck = Checkpointer(directory, save_every=1, keep=1, async_save=False)
  try:
    return bool(ck.all_steps())
  finally:
    ck.close()


def load_params_and_meta(directory: str, config, shardings=None) -> tuple:
  """(params, meta) saved by `save_params`, or (None, None) when there are none.

  `shardings` (a Sharding per param, e.g. the train step's) places them on this run's devices;
  without it every param goes to this process's first device. A target with shardings is what lets a
  checkpoint written on other devices (a CPU run's SFT read on a GPU, another mesh) restore:
  orbax refuses a shardless target when the saved topology differs. A directory holding saves
  of which none restores is an error, not "no params": training anew would then fail to save
  over them, after spending the SFT.
  """
  if not os.path.isdir(directory):
    return None, None
  cfg = qwen3_5.config_from_dict(config.model)
  shapes = jax.eval_shape(lambda: qwen3_5.init_params(cfg, jax.random.key(0)))
  like = {"params": sharding.with_shardings(shapes, shardings)}
  ck = Checkpointer(directory, save_every=1, keep=1, async_save=False)
  try:
    out = ck.restore_latest(like)
    if out is None and ck.skipped:
      step, err = ck.skipped[0]
      raise ValueError(f"{directory} holds saved params (step {step}) that do not restore "
                       f"into config.model: {err.splitlines()[0][:300]}. Move the directory "
                       f"away (or set config.sft.dir) to train anew.")
  finally:
    ck.close()
  return (None, None) if out is None else (out[1]["params"], out[2])


# The files of a checkpoint directory that hold its weights; everything else in it (tokenizer,
# generation defaults, chat template, model card) leaves the start weights as they are.
_WEIGHT_FILE = re.compile(r"(\.safetensors|\.safetensors\.index\.json)$")


def start_fingerprint(config) -> str:
  """What an SFT run starts from: train.init_from's weights or the seeded random init.

  The weight files enter by name, size, and the first and last MiB of each (so a release of
  many GB costs a few reads); config.json enters as the model config it holds, in one fixed
  form (hf_io.canonical_config_bytes; its bytes when it holds none), so rewriting a
  checkpoint's other files (config.json's layout, tokenizer, generation defaults) keeps the
  fingerprint, while other weights or another model config change it. The fixed form is the
  config.json of checkpoints written before exports were text-only, whose fingerprints
  therefore stay what they were."""
  path = config.train.init_from
  if not path:
    return f"random-init-seed-{int(config.seed)}"
  if not os.path.isdir(path):
    raise FileNotFoundError(f"config.train.init_from={path!r} is not a directory")
  h = hashlib.sha256()
  for name in sorted(os.listdir(path)):
    f = os.path.join(path, name)
    if not os.path.isfile(f):
      continue
    if name == "config.json":
      canonical = hf_io.canonical_config_bytes(path)
      if canonical is not None:
        h.update(f"{name}:{len(canonical)};".encode() + canonical[:1 << 20])
        continue
    elif not _WEIGHT_FILE.search(name):
      continue
    size = os.path.getsize(f)
    h.update(f"{name}:{size};".encode())
    with open(f, "rb") as fh:
      h.update(fh.read(1 << 20))
      if size > 2 << 20:
        fh.seek(-(1 << 20), os.SEEK_END)
        h.update(fh.read())
  return h.hexdigest()[:16]
