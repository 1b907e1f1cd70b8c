"""The engine's generate step: the ids it samples are those its contract names, the draw at step s
of a request with seed (lo, hi) from fold_in(fold_in(key(lo), hi), s), whether the batch samples,
mixes greedy and sampling rows, or is all greedy (which skips the draw)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from models import aot
from models import config as config_lib
from models import qwen3_5
from rl.rollout import sampling
from rl.rollout.engine import PrefillInput, QwenEngine, SamplingSettings

_PROMPT, _STEPS = 8, 6


def _model():
  m = base.get_model_config()
  m.initializer_range = 0.2
  cfg = qwen3_5.config_from_dict(m)
  return cfg, qwen3_5.init_params(cfg, jax.random.key(0))


def _engine_ids(engine, prompts, settings):
  handle = engine.load_params()
  state = engine.init_decode_state()
  for slot, (p, s) in enumerate(zip(prompts, settings)):
    prefix = engine.prefill(params=handle, padded_tokens=PrefillInput(p, s), true_length=_PROMPT)
    state = engine.insert(prefix, state, slot)
  ids = []
  for _ in range(_STEPS):
    state, res = engine.generate(handle, state)
    ids.append(np.asarray(res.data)[:, 0])
  return np.stack(ids, axis=1)


def _reference_ids(cfg, params, prompts, settings):
  """The same requests decoded together by the model's own prefill / decode_step and the
  sampler, with each row's key derived as the engine documents."""
  prefill = jax.jit(qwen3_5.prefill, static_argnums=(0, 4))
  decode_step = jax.jit(qwen3_5.decode_step, static_argnums=(0,))
  sample = jax.jit(sampling.sample)
  logits, cache = prefill(cfg, params, jnp.asarray(np.stack(prompts)),
                          jnp.full((len(prompts),), _PROMPT, jnp.int32), 32)
  temp = jnp.asarray([s.temperature for s in settings], jnp.float32)
  top_k = jnp.asarray([s.top_k for s in settings], jnp.int32)
  top_p = jnp.asarray([s.top_p for s in settings], jnp.float32)
  base_keys = [jax.random.fold_in(jax.random.key(np.uint32(s.seed)), np.uint32(0))
               for s in settings]
  ids = []
  for step in range(_STEPS):
    keys = jnp.stack([jax.random.fold_in(k, step) for k in base_keys])
    tok, _ = sample(logits, temp, top_k, top_p, keys)   # the sampler's choice on the device
    ids.append(np.asarray(tok))
    logits, cache = decode_step(cfg, params, cache, tok)
  return np.stack(ids, axis=1)


@pytest.mark.slow  # ~40 s: three engine runs and their references
def test_sampled_ids_follow_the_documented_keys_in_sampling_mixed_filtering_and_greedy_batches():
  """The engine picks the sampler's kind on the host (from the slots' settings); each batch
  samples the ids the sampler gives when it decides on the device."""
  cfg, params = _model()
  engine = QwenEngine(cfg, slots=4, max_len=32, prefill_buckets=(_PROMPT,), params=params)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(10, cfg.vocab_size, _PROMPT).astype(np.int32) for _ in range(4)]
  batches = {
      "sampling": [SamplingSettings(temperature=1.0, seed=s) for s in (5, 6, 7, 8)],
      "mixed": [SamplingSettings(temperature=t, seed=s)
                for t, s in ((1.0, 5), (0.0, 6), (0.7, 7), (0.0, 8))],
      "greedy": [SamplingSettings(temperature=0.0, seed=s) for s in (5, 6, 7, 8)],
      "filtering": [SamplingSettings(temperature=1.0, top_k=3, seed=5),
                    SamplingSettings(temperature=0.0, seed=6),
                    SamplingSettings(temperature=1.3, top_p=0.6, seed=7),
                    SamplingSettings(temperature=1.0, seed=8)],
      # A greedy row's top-k filters nothing: the batch runs the greedy program.
      "greedy with top-k": [SamplingSettings(temperature=0.0, top_k=2, seed=s) for s in (5, 6, 7, 8)],
  }
  for name, settings in batches.items():
    got = _engine_ids(engine, prompts, settings)
    np.testing.assert_array_equal(got, _reference_ids(cfg, params, prompts, settings),
                                  err_msg=name)
  # Sampling rows really sample: the same request with another seed takes other ids.
  other = [SamplingSettings(temperature=1.0, seed=s) for s in (15, 16, 17, 18)]
  assert (_engine_ids(engine, prompts, other) != _engine_ids(
      engine, prompts, batches["sampling"])).any()


@pytest.mark.parametrize("temperature,top_k,choice,kind", [
    (1.0, 0, "host", "draw"), (0.0, 0, "host", "greedy"), (1.0, 5, "host", "filter"),
    (1.0, 0, "device", None)])
def test_the_generate_step_compiled_for_a_gpu_never_stops_the_host(temperature, top_k, choice,
                                                                  kind):
  """The generate program of the sampler kind an engine's default settings run (compile mode,
  one H200 target) has no conditional and no loop XLA cannot count: the host queues each step
  without waiting for the device. Chosen on the device (`rollout.sampler_choice`), the
  sampler's two conditionals and the keys' are host waits."""
  c = base.get_config()
  c.rollout.temperature, c.rollout.top_k = temperature, top_k
  c.rollout.max_len, c.rollout.max_slots = 64, 4
  c.rollout.sampler_choice = choice
  devices = aot.target_devices("h200:1x1")
  with config_lib.compiling_for("gpu"):
    engine = QwenEngine.from_config(c, devices=devices)
    hlo = engine.lower_programs((16,))["generate"].compile().as_text()
  costs = aot.hlo_costs(hlo)
  assert not costs["unknown_trip_counts"]
  if kind is None:
    assert costs["host_syncs"] >= 2
    return
  assert costs["host_syncs"] == 0
  # The kind the defaults pick: only the filter sorts the vocabulary.
  assert (" sort(" in hlo) == (kind == "filter")
