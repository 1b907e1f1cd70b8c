"""The judge model served by the run itself: `envs.judge.checkpoint`, any Hugging Face Qwen3.5
folder, on the project's own JetStream engine behind its OpenAI-compatible HTTP front.

    with judged(config) as cfg:     # cfg.envs.judge.endpoint = the served judge's URL
      ...                           # graders (envs/judge.py) reach the judge through it

The judge is an engine of its own, apart from the policy's: its model config comes from the
checkpoint's config.json, its tokenizer from the checkpoint's tokenizer files (when it has them),
and it never loads the policy's published weights. Only the serving knobs (`rollout.max_len`,
buckets, mesh, dtypes of the activations) are the run's. `judged` hands out a copy of the
config with the endpoint and the served model name filled in; the run's own config is left as
it was (it may be locked, and it is what the run records).
"""
import contextlib
import dataclasses
import os
from typing import Callable

from envs.chat.format import ChatFormat
from envs.chat.tokenizer import load_tokenizer
from models import hf_io
from models import qwen3_5
from rl.rollout import serve

# config.model keys that say how to run a model, not which model it is: kept from the run.
_RUNTIME_KEYS = ("preset", "param_dtype", "dtype", "scan_layers", "remat", "gdn_chunk_size",
                 "attention_query_chunk", "attention_causal_block", "logits_chunk", "gdn_precision",
                 "gdn_scan", "decode_attention", "gdn_decode")


@dataclasses.dataclass
class JudgeServer:
  """A served judge: `url` (OpenAI base URL, .../v1), `model` (its id) and `close()`."""
  url: str
  model: str
  close: Callable[[], None]
  engine: object = None


def judge_config(config, checkpoint: str):
  """The judge engine's run config: `config`'s serving settings around the checkpoint's model.

  Args:
    config: the run's config (not modified).
    checkpoint: a Hugging Face Qwen3.5 folder (config.json, safetensors, tokenizer files).
  Returns:
    A new ConfigDict: model from the checkpoint's config.json, tokenizer from the folder when
    it holds tokenizer.json, served model id = the folder's name, no weights_dir, any free port.
  """
  if not os.path.isdir(checkpoint):
    raise FileNotFoundError(f"config.envs.judge.checkpoint={checkpoint!r} is not a directory")
  cfg = config.copy_and_resolve_references()
  mc = hf_io.read_config(checkpoint)
  with cfg.unlocked():
    for k in cfg.model.keys():
      if k not in _RUNTIME_KEYS and hasattr(mc, k):
        v = getattr(mc, k)
        cfg.model[k] = tuple(v) if isinstance(v, (list, tuple)) else v
    cfg.model.preset = ""
    cfg.name = os.path.basename(os.path.normpath(checkpoint)) or "judge"
    if os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
      cfg.tokenizer.path = checkpoint
      cfg.tokenizer.special_ids = "auto"
    tok = load_tokenizer(cfg.tokenizer.path, cfg.tokenizer.special_ids)
    cfg.rollout.stop_ids = tuple(ChatFormat(tok, cfg.tokenizer.thinking).stop_ids)
    cfg.rollout.weights_dir = ""
    cfg.rollout.servers = ()
    cfg.rollout.turn_cache = 0
    j = config.envs.judge
    cfg.rollout.slots = int(min(config.rollout.max_slots,
                                max(1, config.harness.num_workers * j.max_concurrency)))
  return cfg


def serve_judge(config, checkpoint: str = "", warmup=None) -> JudgeServer:
  """Loads `checkpoint` (default envs.judge.checkpoint) and serves it on free ports.

  Returns:
    JudgeServer; close() stops the HTTP front and the engine.
  """
  checkpoint = checkpoint or config.envs.judge.checkpoint
  cfg = judge_config(config, checkpoint)
  model_cfg = qwen3_5.config_from_dict(cfg.model)
  _, params = qwen3_5.load_hf(checkpoint, dtype=model_cfg.jnp_param_dtype)
  server = serve.build_server(cfg, params=params, port=0, warmup=warmup)
  try:
    front = serve.start_http(server, cfg, port=0)
  except BaseException:
    server.stop()
    raise

  def close():
    front.stop()
    server.stop()
  print(f"judge: {checkpoint} served at {front.url} (model {front.model_name!r})", flush=True)
  return JudgeServer(front.url, front.model_name, close, server.engine)


@contextlib.contextmanager
def judged(config, warmup=None):
  """The config graders should use: `config` itself unless envs.judge.checkpoint is set and
  envs.judge.endpoint is empty; then a copy whose envs.judge.endpoint and envs.judge.model name
  the judge served for the duration of the block."""
  j = config.envs.judge
  if j.endpoint or not j.checkpoint:
    yield config
    return
  srv = serve_judge(config, j.checkpoint, warmup=warmup)
  try:
    cfg = config.copy_and_resolve_references()
    with cfg.unlocked():
      cfg.envs.judge.endpoint = srv.url
      cfg.envs.judge.model = srv.model
    yield cfg
  finally:
    srv.close()
