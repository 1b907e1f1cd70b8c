"""The rollout server with LoRA: a frozen base served, weight syncs of adapters alone, merged
by the engine; its tokens and logprobs against the train step's own recompute."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_cpu
from envs.harness.policy import SamplingParams
from models import lora
from models import qwen3_5
from models import sharding
from rl import train_step
from rl.rollout import capacity
from rl.rollout import serve
from tests.rl.rollout import server_utils
from rl.rollout.published_weights import WeightPublisher
from rl.rollout.published_weights import WeightWatcher

MAX_LEN = 64
PROMPT = [900, 3, 3, 77, 12, 640, 8]


@pytest.fixture(scope="module")
def config():
  c = tiny_cpu.get_config()
  c.unlock()
  c.rollout.slots = 2
  c.rollout.max_len = MAX_LEN
  c.rollout.prefill_buckets = (16, 32)
  c.model.initializer_range = 0.2     # logits far from ties: greedy comparisons are meaningful
  c.lora.rank, c.lora.alpha = 4, 8.0
  return c


@pytest.fixture(scope="module")
def model(config):
  cfg = qwen3_5.config_from_dict(config.model)
  spec = lora.from_config(config.lora)
  base = qwen3_5.init_params(cfg, jax.random.key(config.seed))
  adapters = lora.init(spec, qwen3_5.param_axes(cfg), base, jax.random.key(1))
  # Trained adapters stand-in: B away from zero, so the served model is not the base.
  adapters = jax.tree_util.tree_map_with_path(
      lambda p, x: 0.05 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
      if p[-1].key == "b" else x, adapters)
  return cfg, spec, base, adapters


@pytest.fixture(scope="module")
def server(config, model):
  yield from server_utils.running_server(config, model[2])


@pytest.fixture(scope="module")
def client(server):
  yield from server_utils.running_client(server)


def _recompute_logprobs(cfg, model_params, seq):
  tokens = np.zeros((1, MAX_LEN), np.int32)
  tokens[0, :len(seq)] = seq
  lp, _ = train_step.token_logprobs(cfg, model_params, jnp.asarray(tokens), 1.0)
  return np.asarray(lp[0])


def test_a_sync_moves_only_the_adapters_and_engine_logprobs_equal_the_train_recompute(
    server, client, model):
  cfg, spec, base, adapters = model
  sampling = SamplingParams(temperature=1.0, seed=123)
  before = client.generate(PROMPT, sampling, max_tokens=10, stop_ids=[])
  server.update_weights(adapters, version=1)
  assert server.engine.last_sync_bytes == lora.byte_count(adapters)
  assert server.engine.last_sync_bytes * 5 < lora.byte_count(base)
  out = client.generate(PROMPT, sampling, max_tokens=10, stop_ids=[])
  assert out.ids != before.ids                  # the adapters changed the policy
  seq = PROMPT + out.ids
  # The train step's recompute: the base with adapters merged layer by layer in the scan.
  want = _recompute_logprobs(cfg, lora.attach(base, adapters, spec.scale), seq)
  # The engine decodes with the recurrent Gated DeltaNet, the train step runs the chunked form:
  # float32 sums in another order, ~1.3e-4 apart after 10 tokens on some x86 CPUs (1e-4 held
  # on others). A merge or sync that went wrong moves them by whole units.
  np.testing.assert_allclose(np.asarray(out.logprobs, np.float32),
                             want[len(PROMPT):len(seq)], atol=3e-4, rtol=0)


def test_greedy_tokens_after_syncs_are_the_merged_models_and_syncs_do_not_accumulate(
    server, client, model):
  """Two syncs in a row serve the second adapters merged into the base (not into the weights
  the first sync served), and adapters back at B = 0 serve the base exactly."""
  cfg, spec, base, adapters = model
  full = jax.jit(functools.partial(qwen3_5.forward, cfg))

  def greedy(params, n=6):
    ids = list(PROMPT)
    for _ in range(n):
      tokens = np.zeros((1, MAX_LEN), np.int32)
      tokens[0, :len(ids)] = ids
      ids.append(int(jnp.argmax(full(params, jnp.asarray(tokens))[0, len(ids) - 1])))
    return ids[len(PROMPT):]

  other = jax.tree.map(lambda x: -x, adapters)
  greedy_sampling = SamplingParams(temperature=0.0)
  server.update_weights(adapters, version=2)
  server.update_weights(other, version=3)
  got = client.generate(PROMPT, greedy_sampling, max_tokens=6, stop_ids=[])
  assert got.ids == greedy(lora.merge(base, other, spec.scale))
  zero_b = jax.tree_util.tree_map_with_path(
      lambda p, x: jnp.zeros_like(x) if p[-1].key == "b" else x, adapters)
  server.update_weights(zero_b, version=4)
  assert client.generate(PROMPT, greedy_sampling, max_tokens=6, stop_ids=[]).ids == greedy(base)
  served, _ = server.engine.load_params().get()
  # Held with each Gated DeltaNet layer's input projections as one matrix (engine_weights.py).
  assert "in_proj" in served["blocks"][0]["mixer"]
  served = qwen3_5.split_gdn_in_projections(cfg, served)
  for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_whole_param_tree_is_refused_by_a_lora_engine(server, model):
  with pytest.raises(ValueError, match="adapters"):
    server.update_weights(model[2])


@pytest.mark.parametrize("scan_layers", [True, False])
def test_adapters_from_a_sharded_train_state_merge_on_the_engine(config, model, scan_layers):
  """The RL loop syncs the train state's adapters as laid out by the train mesh (experts'
  adapters split over `expert`); the engine reshards them onto its own devices, and with its
  weights held layer by layer (`rollout.scan_layers=False`) merges them layer by layer."""
  cfg, spec, base, adapters = model
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.mesh.shape = (1, 2, 2, 2)
  served_config = config.copy_and_resolve_references()
  with served_config.unlocked():
    served_config.rollout.scan_layers = scan_layers
  mesh = sharding.make_mesh(c.mesh)
  rules = sharding.rules_from_config(c.mesh.rules)
  sh = sharding.tree_shardings(lora.axes(spec, qwen3_5.param_axes(cfg)), adapters, mesh, rules)
  train_like = jax.device_put(adapters, sh)
  assert train_like["blocks"][0]["ffn"]["wi_up"]["a"].sharding.spec[1] == "expert"
  s = serve.build_server(served_config, params=base, port=0, warmup=False)
  try:
    s.update_weights(train_like, version=1)
    served, _ = s.engine.load_params().get()
    served = qwen3_5.split_gdn_in_projections(cfg, served)
    want = lora.merge(base, adapters, spec.scale)
    if not scan_layers:
      want = qwen3_5.unscan_layers(cfg, want)
    assert jax.tree.structure(served) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  finally:
    s.stop()


def test_a_server_job_serves_published_adapters_merged_into_its_base(server, client, model,
                                                                     tmp_path):
  """A rollout server run as its own job (rollout.servers): the trainer publishes the adapters
  alone, the server restores them (`sync_target`) and serves them merged into its base."""
  cfg, spec, base, adapters = model
  weights_dir = str(tmp_path / "weights")
  watcher = WeightWatcher(weights_dir, server.engine, poll_s=0.05).start()
  publisher = WeightPublisher(weights_dir, [server.address], timeout_s=120, poll_s=0.05)
  try:
    assert publisher.update_weights(adapters, 10) == 10
    saved = publisher._ckpt.saved_state_metadata(10)["params"]  # pylint: disable=protected-access
    assert sharding.shape_dtype_mismatches(saved, adapters) == []   # the adapters, nothing else
    full = jax.jit(functools.partial(qwen3_5.forward, cfg))
    merged = lora.merge(base, adapters, spec.scale)
    ids = list(PROMPT)
    for _ in range(6):
      tokens = np.zeros((1, MAX_LEN), np.int32)
      tokens[0, :len(ids)] = ids
      ids.append(int(jnp.argmax(full(merged, jnp.asarray(tokens))[0, len(ids) - 1])))
    out = client.generate(PROMPT, SamplingParams(temperature=0.0), max_tokens=6, stop_ids=[])
    assert (out.ids, out.weights_version) == (ids[len(PROMPT):], 10)
  finally:
    publisher.stop()
    watcher.stop()


def test_the_capacity_planner_counts_the_base_a_lora_engine_keeps_beside_its_served_weights(
    config, model):
  cfg, spec, base, _ = model
  full = config.copy_and_resolve_references()
  with full.unlocked():
    full.lora.rank = 0
  adapted = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(base)
                if jax.tree_util.keystr(p, simple=True, separator="/")
                in set(lora.adapted_paths(spec, qwen3_5.param_axes(cfg))))
  with_lora, without = capacity.plan_from_config(config, 1), capacity.plan_from_config(full, 1)
  per_param = without.weight_bytes // qwen3_5.count_params(cfg)["total"]
  assert with_lora.weight_bytes - without.weight_bytes == adapted * per_param > 0
