"""A token-in/token-out policy that runs the Qwen3.5 model in-process (reference decode).

For `--config.policy=model` without a JetStream server, and for harness tests against the
tiny model: prefill the prompt (padded to a power-of-two bucket, so few shapes compile),
then decode one token at a time with the model's own cache, sampling at the configured
temperature and returning the logprob of each sampled id under the sampling distribution.
It is slow (one jitted step per token, one sequence at a time) and exists so the harness can
be exercised end to end on CPU; the engine in rl/rollout serves real rollouts. Importing this
module imports JAX (the harness eval imports it only for harness.policy_backend=local).
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models import config as model_config
from models import qwen3_5


class LocalModelPolicy:
  """Args:
    fmt: the chat format (only its vocabulary size is checked).
    model_cfg: the `model` config section as a dict.
    max_len: decode-cache capacity (prompt + sampled tokens), fixed so decode compiles once.
    seed: init seed of the random parameters when `params` is None.
    params: a parameter pytree; None = random init (an untrained tiny model).
  """

  def __init__(self, fmt, model_cfg: dict, max_len: int, seed: int = 0, params=None):
    self.cfg = model_config.from_config_dict(model_cfg)
    if self.cfg.vocab_size < fmt.tok.vocab_size:
      raise ValueError(f"model vocab {self.cfg.vocab_size} < tokenizer vocab "
                       f"{fmt.tok.vocab_size}")
    self.params = params if params is not None else qwen3_5.init_params(
        self.cfg, jax.random.key(seed))
    self.max_len = max_len
    self._prefill = jax.jit(functools.partial(qwen3_5.prefill, self.cfg),
                            static_argnames=("max_len",))
    self._decode = jax.jit(functools.partial(qwen3_5.decode_step, self.cfg))

  def generate(self, prompt_ids, sampling, max_tokens, stop_ids):
    n = len(prompt_ids)
    if n + 1 > self.max_len:
      raise ValueError(f"prompt of {n} tokens does not fit the cache of {self.max_len}")
    max_tokens = min(max_tokens, self.max_len - n)
    bucket = min(self.max_len, max(64, 1 << math.ceil(math.log2(n))))
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :n] = prompt_ids
    logits, cache = self._prefill(self.params, jnp.asarray(tokens),
                                  jnp.asarray([n], jnp.int32), max_len=self.max_len)
    rng = np.random.default_rng([sampling.seed or 0, n, int(sum(prompt_ids[-32:]))])
    ids, lps = [], []
    stops = set(stop_ids)
    for _ in range(max_tokens):
      tok, lp = _sample(np.asarray(logits[0], np.float64), sampling, rng)
      ids.append(tok)
      lps.append(lp)
      if tok in stops:
        return ids, lps, "stop"
      logits, cache = self._decode(self.params, cache, jnp.asarray([tok], jnp.int32))
    return ids, lps, "length"


def _sample(logits: np.ndarray, sampling, rng) -> tuple[int, float]:
  """One id and its logprob under the distribution it was drawn from."""
  if sampling.top_p != 1.0:
    raise NotImplementedError("the local policy samples with temperature and top_k only")
  if sampling.temperature == 0:
    tok = int(np.argmax(logits))
    return tok, 0.0
  z = logits / sampling.temperature
  if sampling.top_k:
    kth = np.partition(z, -sampling.top_k)[-sampling.top_k]
    z = np.where(z >= kth, z, -np.inf)
  z = z - z.max()
  logp = z - np.log(np.exp(z).sum())
  tok = int(rng.choice(len(z), p=np.exp(logp)))
  return tok, float(logp[tok])


def local_model_factory(config):
  """A picklable factory for the pool, from the config (random tiny model)."""
  return functools.partial(_build, config.model.to_dict(), int(config.train.max_context),
                           int(config.seed))


def _build(model_cfg, max_len, seed, fmt):
  return LocalModelPolicy(fmt, model_cfg, max_len, seed)
