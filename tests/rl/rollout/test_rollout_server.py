"""The JetStream rollout server on localhost, through gRPC, against the model's own maths.

One server for the module (tiny model, 2 slots, 64-token context, prompts in the 16 bucket),
so everything compiles once.
"""
import concurrent.futures
import functools
import threading
import time

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import tiny_cpu
from envs.harness.jetstream_client import EngineError
from envs.harness.jetstream_client import JetStreamPolicy
from envs.harness.jetstream_client import TokenClient
from envs.harness.policy import SamplingParams
from models import qwen3_5
from models import sharding
from models.layers import gated_deltanet
from models.sharding import MeshError
from rl import train_step
from rl.rollout import serve
from tests.rl.rollout import server_utils
from rl.rollout.engine import QwenEngine
from rl.rollout.engine import engine_mesh

# JetStream after rl.rollout, whose seqio stand-in lets it import (and whose compat module
# undoes the root-logger change its orchestrator makes on import).
from jetstream.core import orchestrator as jetstream_orchestrator
from jetstream.core.proto import jetstream_pb2
from jetstream.core.proto import jetstream_pb2_grpc
from jetstream.engine import engine_api

SLOTS = 2
MAX_LEN = 64
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[5, 17, 300, 41], [900, 3, 3, 77, 12, 640, 8], [11], [400, 401, 402, 403, 404, 405,
                                                               406, 407, 408, 409, 410, 411]]


@pytest.fixture(scope="module")
def config():
  c = tiny_cpu.get_config()
  c.unlock()
  c.rollout.slots = SLOTS
  c.rollout.max_len = MAX_LEN
  c.rollout.prefill_buckets = (16, 32)
  # A wider init than the default makes the tiny model's logits far from ties, so greedy
  # comparisons across two numerical paths are meaningful.
  c.model.initializer_range = 0.2
  return c


@pytest.fixture(scope="module")
def model(config):
  cfg = qwen3_5.config_from_dict(config.model)
  return cfg, qwen3_5.init_params(cfg, jax.random.key(config.seed))


@pytest.fixture(scope="module")
def server(config, model):
  yield from server_utils.running_server(config, model[1])


@pytest.fixture(scope="module")
def client(server):
  yield from server_utils.running_client(server)


@pytest.fixture(scope="module")
def full_forward(model):
  cfg = model[0]
  return jax.jit(functools.partial(qwen3_5.forward, cfg))


def greedy_by_recompute(full_forward, params, prompt, n):
  """The model's own greedy continuation, each token from a full forward over the prefix."""
  ids = list(prompt)
  for _ in range(n):
    tokens = np.zeros((1, MAX_LEN), np.int32)  # right padding: causal, so it changes nothing
    tokens[0, :len(ids)] = ids
    logits = full_forward(params, jnp.asarray(tokens))
    ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
  return ids[len(prompt):]


def test_greedy_equals_full_recompute(client, model, full_forward):
  for prompt in PROMPTS:
    out = client.generate(prompt, GREEDY, max_tokens=8, stop_ids=[])
    assert out.finish_reason == "length"
    assert out.ids == greedy_by_recompute(full_forward, model[1], prompt, 8), prompt
    assert out.logprobs == [0.0] * 8


def test_logprobs_equal_train_step_recompute(client, model):
  cfg, params = model
  prompt = PROMPTS[1]
  out = client.generate(prompt, SamplingParams(temperature=1.0, seed=123), max_tokens=10,
                        stop_ids=[])
  seq = prompt + out.ids
  tokens = np.zeros((1, MAX_LEN), np.int32)
  tokens[0, :len(seq)] = seq
  lp, _ = jax.jit(lambda p, t: train_step.token_logprobs(cfg, p, t, 1.0))(params, tokens)
  ref = np.asarray(lp[0, len(prompt):len(seq)])
  np.testing.assert_allclose(np.asarray(out.logprobs, np.float32), ref, atol=1e-4, rtol=0)
  # Seeded: the same request samples the same ids.
  again = client.generate(prompt, SamplingParams(temperature=1.0, seed=123), max_tokens=10,
                          stop_ids=[])
  assert again.ids == out.ids


def test_continuous_batching_three_times_the_slots(client):
  reqs = [(p, GREEDY) for p in PROMPTS] + [
      (PROMPTS[0], SamplingParams(temperature=1.0, seed=5)),
      (PROMPTS[2], SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=9))]
  assert len(reqs) == 3 * SLOTS
  alone = [client.generate(p, s, max_tokens=6, stop_ids=[]) for p, s in reqs]
  with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
    together = list(pool.map(lambda r: client.generate(r[0], r[1], max_tokens=6, stop_ids=[]),
                             reqs))
  for a, b in zip(alone, together):
    assert a.ids == b.ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_stop_ids_and_max_tokens(client):
  prompt = PROMPTS[0]
  free = client.generate(prompt, GREEDY, max_tokens=8, stop_ids=[]).ids
  i = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 1)
  out = client.generate(prompt, GREEDY, max_tokens=8, stop_ids=[free[i], 1023 if free[i] != 1023 else 1022])
  assert out.ids == free[:i + 1] and out.finish_reason == "stop"  # the stop id is returned last
  out = client.generate(prompt, GREEDY, max_tokens=3, stop_ids=[])
  assert out.ids == free[:3] and out.finish_reason == "length"
  # The harness's policy interface over the same client.
  ids, lps, finish = JetStreamPolicy(client).generate(prompt, GREEDY, 2, [])
  assert ids == free[:2] and lps == [0.0, 0.0] and finish == "length"
  # A request that would overrun the cache ends with "length" at the cache's end.
  long_prompt = list(range(100, 116))
  out = client.generate(long_prompt, GREEDY, max_tokens=1000, stop_ids=[])
  assert len(out.ids) == MAX_LEN - len(long_prompt) and out.finish_reason == "length"


@pytest.mark.parametrize("prompt,needle", [
    ([], "empty prompt"),
    ([5, 1024, 7], "outside the vocabulary"),
    ([5, -3], "outside the vocabulary"),
    (list(range(1, MAX_LEN + 6)), "longer than the context"),
])
def test_malformed_requests_get_clear_errors(client, prompt, needle):
  with pytest.raises(EngineError) as e:
    client.generate(prompt, GREEDY, max_tokens=4, stop_ids=[])
  assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details
  assert len(client.generate(PROMPTS[2], GREEDY, max_tokens=2, stop_ids=[]).ids) == 2


def test_disconnect_mid_stream_frees_the_slot(client, server):
  before = server.driver.cancelled_requests
  call = client.stream(PROMPTS[1], GREEDY, max_tokens=50, stop_ids=[])
  first = next(iter(call))
  assert len(first.stream_content.samples[0].token_ids) == 1
  call.cancel()
  deadline = time.time() + 20
  while time.time() < deadline and (server.busy_slots() > 0
                                    or server.driver.cancelled_requests == before):
    time.sleep(0.05)
  assert server.busy_slots() == 0
  assert server.driver.cancelled_requests == before + 1
  assert client.generate(PROMPTS[0], GREEDY, max_tokens=2, stop_ids=[]).finish_reason == "length"


def test_jetstream_own_client_and_health(server):
  with grpc.insecure_channel(server.address) as ch:
    stub = jetstream_pb2_grpc.OrchestratorStub(ch)
    assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest()).is_live
    req = jetstream_pb2.DecodeRequest(
        max_tokens=3, token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=PROMPTS[0]))
    ids = [t for r in stub.Decode(req) for s in r.stream_content.samples for t in s.token_ids]
    assert len(ids) <= 3  # engine default sampling, config stop ids
    req = jetstream_pb2.DecodeRequest(
        max_tokens=3, text_content=jetstream_pb2.DecodeRequest.TextContent(text="hello"))
    texts = [s.text for r in stub.Decode(req) for s in r.stream_content.samples]
    assert texts and all(isinstance(t, str) for t in texts)
  assert TokenClient(server.address).health()


def test_weight_update_takes_effect_without_recompile(client, server, model, full_forward):
  cfg, old = model
  engine = server.engine
  programs = engine.programs
  compiled = (programs.generate._cache_size(), programs.prefill._cache_size(),
              programs.insert._cache_size())
  new = qwen3_5.init_params(cfg, jax.random.key(99))
  v0 = engine.params_version
  try:
    assert server.update_weights(new) == v0 + 1
    for prompt in PROMPTS[:2]:
      out = client.generate(prompt, GREEDY, max_tokens=6, stop_ids=[])
      assert out.ids == greedy_by_recompute(full_forward, new, prompt, 6)
      assert out.weights_version == v0 + 1
    assert out.ids != greedy_by_recompute(full_forward, old, PROMPTS[1], 6)
    assert (programs.generate._cache_size(), programs.prefill._cache_size(),
            programs.insert._cache_size()) == compiled
    bad = dict(new, embed=new["embed"][:, :-1])
    with pytest.raises(ValueError, match="recompile"):
      server.update_weights(bad)
  finally:
    server.update_weights(old)


@pytest.mark.parametrize("train_devices", [1, 8])
def test_weights_synced_from_a_donated_train_state_stay_served(client, server, model, full_forward,
                                                               train_devices):
  """The RL loop syncs the train state's device arrays (no host copy); the next train step
  donates that state. The engine serves its own copy, so it keeps generating with them, also
  when the train state already sits where the engine serves (one device: no reshard)."""
  cfg, old = model
  new = qwen3_5.init_params(cfg, jax.random.key(7))
  want = {i: greedy_by_recompute(full_forward, new, PROMPTS[i], 6) for i in (0, 1)}
  mesh = jax.make_mesh((train_devices,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:train_devices])
  train_like = jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp") if x.shape[0] % 8 == 0 else P()),
                           may_alias=False),
      new)
  donating_step = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.5, p), donate_argnums=0)
  try:
    server.update_weights(train_like)
    stepped = jax.block_until_ready(donating_step(train_like))
    assert all(x.is_deleted() for x in jax.tree.leaves(train_like))
    for i in (0, 1):
      assert client.generate(PROMPTS[i], GREEDY, max_tokens=6, stop_ids=[]).ids == want[i]
    del stepped
  finally:
    server.update_weights(old)


@pytest.mark.parametrize("layout", ["rows", "context_parallel", "whole_weights", "gpu_kernels"])
def test_engine_on_a_mesh_from_config_serves_the_models_greedy_tokens(config, model, full_forward,
                                                                      layout):
  """`rollout.mesh_shape` (1, 2, 2, 2): the engine's params and decode state spread over 8
  devices; served tokens equal the recompute, before and after a weight sync from a train
  layout on the same devices. Under the full-size configs' context-parallel rules the engine
  keeps whole rows: its slots split over the batch axes, fsdp included. With
  `rollout.whole_weights` no weight's embed dimension is split (the routed experts stay split
  over `expert`). With the GPU kernels (Pallas' interpreter here: `moe_dispatch=blocked_fused`,
  its decode reading every layer's stacked experts, `decode_attention=fused` and
  `gdn_decode=fused`, each state updated in place in the stack), each run per device in its
  shard_map."""
  cfg, old = model
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.rollout.mesh_shape = (1, 2, 2, 2)
    if layout == "context_parallel":
      c.mesh.rules = sharding.context_parallel_rules(c.mesh.rules, "fsdp")
    c.rollout.whole_weights = layout == "whole_weights"
    if layout == "gpu_kernels":
      c.model.moe_dispatch, c.model.decode_attention = "blocked_fused", "fused"
      c.model.gdn_decode = "fused"
  s = serve.build_server(c, params=old, port=0, warmup=False)
  client = TokenClient(s.address, timeout_s=120)
  try:
    assert s.engine.mesh.size == 8
    assert dict(s.engine.programs.rules)["activation_length"] is None
    assert "fsdp" in dict(s.engine.programs.rules)["batch"]
    served = s.engine.load_params().get()[0]
    assert len(served["embed"].sharding.device_set) == 8
    embed_split = served["embed"].sharding.spec[1:]       # [vocab, embed]
    assert (embed_split in ((), (None,))) == (layout == "whole_weights"), served["embed"].sharding
    _serves_greedy_tokens_before_and_after_a_sync(s, client, full_forward, cfg, old)
  finally:
    client.close()
    s.stop()


def _serves_greedy_tokens_before_and_after_a_sync(s, client, forward, cfg, old):
  """Server `s` serves the greedy tokens of `old` (by `forward`'s recompute), and after a weight
  sync of new params laid out on an 8-device train mesh, theirs."""
  for prompt in PROMPTS[:2]:
    want = greedy_by_recompute(forward, old, prompt, 6)
    assert client.generate(prompt, GREEDY, max_tokens=6, stop_ids=[]).ids == want
  new = qwen3_5.init_params(cfg, jax.random.key(7))
  train_mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  s.update_weights(jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(train_mesh, P("fsdp") if x.shape[0] % 8 == 0
                                                else P())), new))
  want = greedy_by_recompute(forward, new, PROMPTS[0], 6)
  assert client.generate(PROMPTS[0], GREEDY, max_tokens=6, stop_ids=[]).ids == want


def test_an_engine_holding_its_layers_one_by_one_serves_the_models_greedy_tokens(config):
  """`rollout.scan_layers=False` with two layer cycles, on the (1, 2, 2, 2) mesh with every GPU
  kernel (Pallas' interpreter): the engine holds one entry a layer ([1, ...], the model with
  scan_layers=False), cut from the stacks it is given and from each sync's, each Gated DeltaNet
  layer's four input projections as one matrix laid out for the mesh's 2 tensor shards
  (`rollout.fuse_projections`), and serves the scanned model's greedy tokens, before and after a
  weight sync from a train layout."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.model.num_hidden_layers = 8
    c.rollout.mesh_shape = (1, 2, 2, 2)
    c.rollout.scan_layers = False
    c.model.moe_dispatch, c.model.decode_attention = "blocked_fused", "fused"
    c.model.gdn_decode = "fused"
  cfg = qwen3_5.config_from_dict(c.model)
  reference = cfg.replace(moe_dispatch="auto", decode_attention="xla", gdn_decode="xla")
  forward = jax.jit(functools.partial(qwen3_5.forward, reference))
  old = qwen3_5.init_params(cfg, jax.random.key(3))
  s = serve.build_server(c, params=old, port=0, warmup=False)
  client = TokenClient(s.address, timeout_s=120)
  try:
    served = s.engine.load_params().get()[0]
    assert cfg.num_cycles == 2 and len(served["blocks"]) == 8
    np.testing.assert_array_equal(served["blocks"][7]["mixer"]["q_proj"],
                                  old["blocks"][3]["mixer"]["q_proj"][1:2])
    fused = served["blocks"][4]["mixer"]
    assert "in_proj_qkv" not in fused and fused["in_proj"].shape[:3] == (1, cfg.hidden_size, 2)
    assert fused["in_proj"].sharding.shard_shape(fused["in_proj"].shape)[2] == 1
    apart = gated_deltanet.split_in_projections(jax.device_get(fused), reference)
    for k in gated_deltanet.IN_PROJECTIONS:
      np.testing.assert_array_equal(apart[k], old["blocks"][0]["mixer"][k][1:2], err_msg=k)
    assert len(served["embed"].sharding.device_set) == 8
    _serves_greedy_tokens_before_and_after_a_sync(s, client, forward, cfg, old)
  finally:
    client.close()
    s.stop()


def test_weights_served_in_bfloat16_are_the_synced_weights_cast(config, model, full_forward):
  """rollout.weights_dtype: the engine holds its weight matrices in bfloat16 and its vectors
  (norm scales, decay parameters) as given, cast from the float32 params it starts from and
  from each weight sync; served tokens are the model's own with those cast weights."""
  cfg, old = model
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.rollout.weights_dtype = "bfloat16"
  s = serve.build_server(c, params=old, port=0, warmup=False)
  client = TokenClient(s.address, timeout_s=120)
  cast = lambda params: jax.tree.map(
      lambda x: x.astype(jnp.bfloat16) if x.ndim >= 2 else x, params)
  try:
    held = jax.tree.leaves(s.engine.load_params().get()[0])
    assert {str(x.dtype) for x in held if x.ndim >= 2} == {"bfloat16"}
    assert {str(x.dtype) for x in held if x.ndim < 2} == {"float32"}
    for prompt in PROMPTS[:2]:
      want = greedy_by_recompute(full_forward, cast(old), prompt, 6)
      assert client.generate(prompt, GREEDY, max_tokens=6, stop_ids=[]).ids == want
    new = qwen3_5.init_params(cfg, jax.random.key(7))
    s.update_weights(new)   # float32 masters, as the train step holds them
    want = greedy_by_recompute(full_forward, cast(new), PROMPTS[0], 6)
    assert client.generate(PROMPTS[0], GREEDY, max_tokens=6, stop_ids=[]).ids == want
  finally:
    client.close()
    s.stop()


def test_an_engine_without_params_initialises_them_where_it_serves_them(config):
  """A served random init is created shard by shard on the engine's mesh, in its dtypes and
  its layout (a model that needs the mesh does not fit one device)."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.rollout.mesh_shape = (1, 2, 2, 2)
    c.rollout.weights_dtype = "bfloat16"
  engine = QwenEngine.from_config(c)
  held = engine.load_params().get()[0]
  want = engine.params_target(held=True)
  assert jax.tree.structure(held) == jax.tree.structure(want)
  assert "in_proj" in held["blocks"][0]["mixer"]   # rollout.fuse_projections
  for x, t in zip(jax.tree.leaves(held), jax.tree.leaves(want)):
    assert (x.dtype, x.sharding) == (t.dtype, t.sharding)
  assert held["embed"].dtype == jnp.bfloat16
  assert len(held["embed"].addressable_shards) == 8
  assert held["embed"].addressable_shards[0].data.size < held["embed"].size


def test_engine_mesh_takes_the_devices_it_names_and_refuses_more_than_there_are(config):
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.rollout.mesh_shape = (1, 3, 3, 1)     # 9 of the 8 devices
  with pytest.raises(MeshError, match="rollout.mesh_shape"):
    engine_mesh(c)
  with c.unlocked():
    c.rollout.mesh_shape = (1, 1, 1, 2)     # the first 2 of 8
  assert engine_mesh(c)[0].devices.size == 2
  with c.unlocked():
    c.rollout.mesh_shape = (1, 1, 1, 1)     # one device: no mesh
  assert engine_mesh(c) == (None, None)


def test_generate_thread_survives_the_last_slot_freed_mid_step(server, monkeypatch):
  """JetStream's slot-count race, forced: the detokenize thread holds the first decode step's
  result until the generate thread (which counted a busy slot and holds one free slot) is in
  its non-blocking look at the backlog, then frees the 1-token request's slot. JetStream's loop
  then asserts with every slot free and its thread wrapper SIGKILLs the process (here
  `os.kill` records instead, so unpatched code shows as a dead server)."""
  kills = []
  monkeypatch.setattr(jetstream_orchestrator.os, "kill", lambda pid, sig: kills.append((pid, sig)))
  driver = server.driver
  slots, n = driver._generate_slots[0], driver._generate_engines[0].max_concurrent_decodes
  backlog, results = driver._generate_backlogs[0], driver._detokenize_backlogs[0]
  plain_backlog, plain_results = type(backlog), type(results)
  in_look, forced, steps = threading.Event(), [], []
  engine = driver._generate_engines[0]
  step = engine.generate
  monkeypatch.setattr(engine, "generate", lambda *a, **k: steps.append(1) or step(*a, **k))

  class HeldResults(plain_results):
    def get(self, block=True, timeout=None):
      item = plain_results.get(self, block, timeout)
      if (isinstance(item, tuple) and isinstance(item[1], engine_api.ResultTokens)
          and not forced):
        in_look.wait(10)
      return item

  class RacyBacklog(plain_backlog):
    def get(self, block=True, timeout=None):
      # Non-blocking: a slot was busy when the loop counted (and the loop holds one more);
      # after a decode step, that is the 1-token request whose result is being held.
      if not block and not forced and steps and slots.qsize() < n - 1:
        in_look.set()
        deadline = time.time() + 10
        while time.time() < deadline and slots.qsize() < n - 1:
          time.sleep(0.005)
        forced.append(slots.qsize() == n - 1)
      return plain_backlog.get(self, block, timeout)

  before = driver.slot_race_restarts
  backlog.__class__, results.__class__ = RacyBacklog, HeldResults
  c = TokenClient(server.address, timeout_s=30)
  try:
    assert len(c.generate(PROMPTS[0], GREEDY, max_tokens=1, stop_ids=[]).ids) == 1
    deadline = time.time() + 10       # the reply can overtake the generate thread's last look
    while not forced and time.time() < deadline:
      time.sleep(0.01)
    assert forced == [True]
    assert len(c.generate(PROMPTS[1], GREEDY, max_tokens=3, stop_ids=[]).ids) == 3
  finally:
    backlog.__class__, results.__class__ = plain_backlog, plain_results
    in_look.set()
    c.close()
  assert kills == [] and driver.slot_race_restarts == before + 1
