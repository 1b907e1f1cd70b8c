"""The sampler: greedy, temperature, top-k, top-p, and the logprob it reports."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models import aot
from rl.rollout import sampling

_sample = jax.jit(sampling.sample)  # eager dispatch of the sort/cond is slow on a busy CPU


def _keys(n, seed=0):
  return jax.random.split(jax.random.key(seed), n)


def test_greedy_rows_take_argmax_with_logprob_zero():
  logits = jnp.asarray([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.0, 0.0]], jnp.float32)
  tok, lp = _sample(logits, jnp.zeros(2), jnp.zeros(2, jnp.int32), jnp.ones(2), _keys(2))
  np.testing.assert_array_equal(tok, [1, 0])
  np.testing.assert_array_equal(lp, [0.0, 0.0])


def test_logprob_is_under_the_filtered_tempered_distribution():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(4, 50)) * 3, jnp.float32)
  temp = jnp.asarray([1.0, 0.7, 1.3, 1.0], jnp.float32)
  top_k = jnp.asarray([0, 5, 0, 3], jnp.int32)
  top_p = jnp.asarray([1.0, 1.0, 0.6, 0.9], jnp.float32)
  for seed in range(5):
    tok, lp = _sample(logits, temp, top_k, top_p, _keys(4, seed))
    for b in range(4):
      z = np.asarray(logits[b], np.float64) / float(temp[b])
      order = np.argsort(-z)
      k = int(top_k[b]) or z.size
      keep = order[:k]
      p = np.exp(z[keep] - z[keep].max())
      p /= p.sum()
      before = np.cumsum(p) - p
      keep = keep[before < float(top_p[b])]
      assert int(tok[b]) in set(keep.tolist())
      ref = z[int(tok[b])] - np.log(np.exp(z[keep]).sum())
      np.testing.assert_allclose(float(lp[b]), ref, atol=1e-5)


def test_unfiltered_temperature_one_equals_model_log_softmax():
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(3, 40)), jnp.float32)
  tok, lp = _sample(logits, jnp.ones(3), jnp.zeros(3, jnp.int32), jnp.ones(3), _keys(3))
  ref = jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], axis=-1)[:, 0]
  np.testing.assert_allclose(lp, ref, atol=1e-6)


def test_same_key_same_draw_regardless_of_neighbours():
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
  keys = _keys(3, 7)
  ones, zk = jnp.ones(3), jnp.zeros(3, jnp.int32)
  tok, lp = _sample(logits, ones, zk, ones, keys)
  other = logits.at[1:].set(jnp.asarray(rng.normal(size=(2, 64)), jnp.float32))
  tok2, lp2 = _sample(other, ones, zk.at[2].set(3), ones.at[1].set(0.5), keys)
  assert int(tok[0]) == int(tok2[0]) and float(lp[0]) == float(lp2[0])


def _sample_without_greedy_skip(logits, temperature, top_k, top_p, keys):
  """The sampler as written before greedy batches skipped the draw: every row drawn."""
  logits = logits.astype(jnp.float32)
  greedy = temperature <= 0
  z = logits / jnp.where(greedy, 1.0, temperature)[:, None]
  needs_filter = jnp.any(((top_k > 0) | (top_p < 1.0)) & ~greedy)
  z = jax.lax.cond(needs_filter, lambda z: sampling._filter_logits(z, top_k, top_p), lambda z: z, z)
  logp = jax.nn.log_softmax(z, axis=-1)
  drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, z)
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
  lp = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  return tokens, jnp.where(greedy, 0.0, lp)


def test_skipping_the_draw_for_all_greedy_batches_changes_no_token_or_logprob():
  rng = np.random.default_rng(3)
  ref = jax.jit(_sample_without_greedy_skip)
  logits = jnp.asarray(rng.normal(size=(6, 300)) * 2, jnp.float32)
  settings = {
      "all greedy": (np.zeros(6), np.zeros(6), np.ones(6)),
      "mixed": (np.asarray([0.0, 1.0, 0.7, 0.0, 1.3, 1.0]), np.asarray([0, 0, 5, 0, 0, 3]),
                np.asarray([1.0, 1.0, 1.0, 1.0, 0.8, 1.0])),
      "all sampled": (np.ones(6), np.zeros(6), np.ones(6)),
  }
  for name, (temp, top_k, top_p) in settings.items():
    args = (logits, jnp.asarray(temp, jnp.float32), jnp.asarray(top_k, jnp.int32),
            jnp.asarray(top_p, jnp.float32))
    for seed in range(4):
      tok, lp = _sample(*args, _keys(6, seed))
      tok_ref, lp_ref = ref(*args, _keys(6, seed))
      np.testing.assert_array_equal(tok, tok_ref, err_msg=name)
      np.testing.assert_allclose(lp, lp_ref, rtol=0, atol=1e-6, err_msg=name)


def test_the_kind_chosen_on_the_host_samples_what_the_device_choice_does():
  """`kind_of` from each row's flags picks the program whose tokens and logprobs are those of
  `sample(kind=None)` (its two `lax.cond`s): greedy, plain draw and filtered batches alike."""
  rng = np.random.default_rng(4)
  logits = jnp.asarray(rng.normal(size=(4, 300)) * 2, jnp.float32)
  batches = {   # temperature, top_k, top_p -> the kind
      "greedy": ((0.0, 0.0, 0.0, 0.0), (0, 3, 0, 0), (1.0, 1.0, 0.5, 1.0)),
      "draw": ((0.0, 1.0, 0.7, 0.0), (4, 0, 0, 0), (1.0, 1.0, 1.0, 0.3)),
      "filter": ((1.0, 1.0, 0.0, 1.3), (0, 5, 0, 0), (1.0, 1.0, 1.0, 0.8)),
  }
  for want, (temp, top_k, top_p) in batches.items():
    temp, top_k, top_p = np.asarray(temp), np.asarray(top_k), np.asarray(top_p)
    greedy = temp <= 0
    kind = sampling.kind_of(greedy, (top_k > 0) | (top_p < 1.0))
    assert kind == want
    args = (logits, jnp.asarray(temp, jnp.float32), jnp.asarray(top_k, jnp.int32),
            jnp.asarray(top_p, jnp.float32))
    on_host = jax.jit(functools.partial(sampling.sample, kind=kind))
    for seed in range(3):
      tok, lp = on_host(*args, _keys(4, seed))
      tok_ref, lp_ref = _sample(*args, _keys(4, seed))
      np.testing.assert_array_equal(tok, tok_ref, err_msg=kind)
      np.testing.assert_allclose(lp, lp_ref, rtol=0, atol=1e-6, err_msg=kind)
  # The filter does run in its kind: a top-1 row then always takes its argmax.
  one = (jnp.ones(4), jnp.asarray([1, 0, 0, 0], jnp.int32), jnp.ones(4))
  filtered = jax.jit(functools.partial(sampling.sample, kind="filter"))
  assert all(int(filtered(logits, *one, _keys(4, s))[0][0]) == int(jnp.argmax(logits[0]))
             for s in range(8))


def test_on_a_gpu_only_the_sampler_that_decides_on_the_device_stops_the_host():
  """Compiled for an H200: `kind=None` is two conditionals, each a copy of its predicate to the
  host and a wait (aot.hlo_costs' `host_syncs`); every kind chosen on the host is none."""
  on = jax.sharding.SingleDeviceSharding(aot.target_devices("h200:1x1")[0])
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on)
  args = (sds((8, 1024), jnp.float32), sds((8,), jnp.float32), sds((8,), jnp.int32),
          sds((8,), jnp.float32), sds((8, 2), jnp.uint32))
  syncs = {}
  for kind in (None,) + sampling.KINDS:
    f = jax.jit(lambda l, t, k, p, key, kind=kind: sampling.sample(
        l, t, k, p, jax.random.wrap_key_data(key), kind=kind))
    syncs[kind] = aot.hlo_costs(f.lower(*args).compile().as_text())["host_syncs"]
  assert syncs == {None: 2, "greedy": 0, "draw": 0, "filter": 0}
