"""Shared helpers of the train-step tests: a small config and a synthetic GRPO batch."""
import jax
import jax.numpy as jnp
import numpy as np

from configs import base
from models import qwen3_5
from rl import train_step


def small_config(**overrides):
  """The base (tiny) model with a short batch; float32 everywhere."""
  c = base.get_config()
  c.train.prompts_per_step = 2
  c.train.samples_per_prompt = 4
  c.train.seq_len = 24
  c.train.steps = 10
  c.optim.lr = 1e-3
  c.optim.eps = 1e-3          # keeps Adam's first update smooth in g (equivalence tests)
  c.rl.filter_zero_variance = True
  c.update_from_flattened_dict(overrides)
  return c


def make_batch(config, params=None, seed=0, prompt_len=6):
  """A GRPO batch: groups of samples, masked prompts, rewards with in-group variance.

  rollout_logprobs come from `params` (when given) plus a little noise, as an inference
  engine in another numeric precision would report them.
  """
  rng = np.random.default_rng(seed)
  g, s, t = config.train.prompts_per_step, config.train.samples_per_prompt, config.train.seq_len
  b = g * s
  vocab = config.model.vocab_size
  tokens = rng.integers(0, vocab, size=(b, t)).astype(np.int32)
  lengths = rng.integers(prompt_len + 2, t + 1, size=b)
  pos = np.arange(t)[None, :]
  loss_mask = ((pos >= prompt_len) & (pos < lengths[:, None])).astype(np.float32)
  group_ids = np.repeat(np.arange(g) * 7 + 3, s).astype(np.int32)
  rewards = rng.integers(0, 2, size=b).astype(np.float32)
  rewards[::s] = 1.0
  rewards[1::s] = 0.0                                    # every group has variance
  if params is not None:
    mc = qwen3_5.config_from_dict(config.model)
    host_params = jax.device_put(jax.device_get(params), jax.devices()[0])
    lp, _ = jax.jit(lambda p, x: train_step.token_logprobs(mc, p, x, config.rl.temperature))(
        host_params, jnp.asarray(tokens))
    lp = np.asarray(lp) + rng.normal(0, 0.01, size=(b, t)).astype(np.float32)
  else:
    lp = np.log(rng.uniform(0.01, 0.9, size=(b, t))).astype(np.float32)
  lp = (lp * loss_mask).astype(np.float32)
  return {"tokens": tokens, "loss_mask": loss_mask, "rollout_logprobs": lp,
          "rewards": rewards, "group_ids": group_ids}
