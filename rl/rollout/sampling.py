"""Per-row sampling with the logprob of the sampled token under the sampling distribution.

Each row carries its own temperature, top-k, top-p and PRNG key, so requests with different
settings share one decode batch. A row's draws depend only on its key and its step count,
never on which slot it sits in or what its neighbours do: a request samples the same ids
alone or in a full batch.

A batch runs one of three kinds of the sampler (`KINDS`): "greedy" (every row greedy: the
argmax alone), "draw" (no sampling row filters: no sort of the vocabulary) or "filter". The
engine knows each row's settings on the host and picks the kind there (`kind_of`), so its
generate program has no branch. Left to the device (`kind=None`), the choice is a `lax.cond`,
and XLA:GPU runs a conditional by copying its predicate to the host and waiting for it: the host
then cannot queue the step's kernels ahead of the device (models/aot.py, `host_syncs`).
"""
import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("greedy", "draw", "filter")


def _filter_logits(z, top_k, top_p):
  """Masks z [B, V] to the top-k then top-p (nucleus) set of each row.

  top_k [B] int32 (0 = off); top_p [B] f32 (1.0 = off). Ties at a threshold are all kept.
  """
  vocab = z.shape[-1]
  sorted_z = -jnp.sort(-z, axis=-1)  # descending
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  kth = jnp.take_along_axis(sorted_z, (k - 1)[:, None], axis=-1)  # [B, 1]
  ranks = jnp.arange(vocab)[None, :]
  sorted_z = jnp.where(ranks < k[:, None], sorted_z, -jnp.inf)
  probs = jax.nn.softmax(sorted_z, axis=-1)
  # Keep the smallest prefix whose mass reaches top_p: token i stays if the mass before it < p.
  before = jnp.cumsum(probs, axis=-1) - probs
  keep = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)
  pth = jnp.take_along_axis(sorted_z, (keep - 1)[:, None], axis=-1)
  threshold = jnp.maximum(kth, pth)
  return jnp.where(z >= threshold, z, -jnp.inf)


def kind_of(greedy, filters) -> str:
  """The sampler's kind for a batch whose rows are greedy (temperature 0) and filter (top-k or
  top-p on) as the host arrays `greedy`, `filters` [B] bool say: what `sample(kind=None)`
  picks on the device for those rows."""
  greedy, filters = np.asarray(greedy, bool), np.asarray(filters, bool)
  if greedy.all():
    return "greedy"
  return "filter" if (filters & ~greedy).any() else "draw"


def sample(logits, temperature, top_k, top_p, keys, kind=None):
  """Draws one token per row.

  Args:
    logits: [B, V] float32 model logits.
    temperature: [B] float32; 0 = greedy.
    top_k: [B] int32; 0 = off.
    top_p: [B] float32; 1.0 = off.
    keys: [B] typed PRNG keys.
    kind: one of KINDS, chosen on the host for these rows (`kind_of`); None = chosen on the
      device (two `lax.cond`s). Each gives every row the same token and logprob.
  Returns:
    (tokens [B] int32, logprobs [B] float32). The logprob is that of the token under the
    distribution it was drawn from: log_softmax(filtered logits / T); 0 for greedy rows
    (a point mass). With T = 1, top_k = 0, top_p = 1 it equals the model's log_softmax, the
    quantity the train step recomputes.
  """
  logits = logits.astype(jnp.float32)
  greedy = temperature <= 0

  def draw(logits):
    """(drawn ids, their logprobs) of every row, as if none were greedy."""
    z = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    # Sorting the vocabulary is the costly part; skip it when no row filters.
    if kind is None:
      needs_filter = jnp.any(((top_k > 0) | (top_p < 1.0)) & ~greedy)
      z = jax.lax.cond(needs_filter, lambda z: _filter_logits(z, top_k, top_p), lambda z: z, z)
    elif kind == "filter":
      z = _filter_logits(z, top_k, top_p)
    logp = jax.nn.log_softmax(z, axis=-1)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, z).astype(jnp.int32)
    return drawn, jnp.take_along_axis(logp, drawn[:, None], axis=-1)[:, 0]

  # The random draw (a Gumbel variate per row and vocabulary entry) and the log-softmax cost
  # more than the argmax and, at a few dozen rows, about as much as the model's decode step:
  # a batch of greedy rows only skips them. A sampling row's draw is the same either way.
  no_draw = lambda logits: (jnp.zeros(logits.shape[:1], jnp.int32),
                            jnp.zeros(logits.shape[:1], jnp.float32))
  if kind is None:
    drawn, lp = jax.lax.cond(jnp.all(greedy), no_draw, draw, logits)
  elif kind in KINDS:
    drawn, lp = (no_draw if kind == "greedy" else draw)(logits)
  else:
    raise ValueError(f"sampler kind {kind!r}: expected one of {KINDS} or None")
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn)
  return tokens, jnp.where(greedy, 0.0, lp)
