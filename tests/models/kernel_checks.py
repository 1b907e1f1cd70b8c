"""Shared setups of the GPU kernels' tests (models/layers/*_fused.py): an 8-CPU-device mesh,
and the whole model decoding under each value of one setting; and of the context-parallel
tests: a gradient on one device and on rows split by position."""
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from configs import base
from models import qwen3_5
from models import sharding


def mesh_2x2x1x2():
  """(mesh, rules, place) of 8 CPU devices as data 2 x fsdp 2 x expert 1 x tensor 2 under the
  default logical rules: place(x, logical axes) puts x on the mesh as the rules lay it out."""
  c = base.get_config()
  c.mesh.shape = (2, 2, 1, 2)
  rules = sharding.rules_from_config(c.mesh.rules)
  mesh = sharding.make_mesh(c.mesh)
  place = lambda x, axes: jax.device_put(
      x, NamedSharding(mesh, sharding.logical_to_spec(axes, rules, mesh, x.shape)))
  return mesh, rules, place


def decode_each_way(setting: str, values) -> dict:
  """The default tiny model's prefill of 3 rows (12, 5 and 9 tokens) then eight decode steps,
  under each of `values` of model `setting`: value -> (the steps' logits, the last cache)."""
  cfg = qwen3_5.config_from_dict(base.get_model_config())
  params = qwen3_5.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (3, 20), 0, cfg.vocab_size)
  lengths = jnp.asarray([12, 5, 9], jnp.int32)
  prefill = jax.jit(qwen3_5.prefill, static_argnums=0, static_argnames=("max_len",))
  step = jax.jit(qwen3_5.decode_step, static_argnums=0)
  runs = {}
  for value in values:
    c = cfg.replace(**{setting: value})
    _, cache = prefill(c, params, tokens[:, :12], lengths, max_len=40)
    logits = []
    for t in range(12, 20):
      out, cache = step(c, params, cache, tokens[:, t])
      logits.append(out)
    runs[value] = (logits, cache)
  return runs


def split_rows_mesh(shape):
  """(mesh, rules) of CPU devices as `shape` (data, fsdp, expert, tensor) with each row's
  positions split over fsdp x expert (context parallelism, the full-size configs' layout)."""
  c = base.get_config()
  c.mesh.shape = shape
  rules = sharding.context_parallel_rules(sharding.rules_from_config(c.mesh.rules),
                                          ("fsdp", "expert"))
  return sharding.make_mesh(c.mesh), rules


def one_device_and_split_rows(grad, params, x, mesh, rules):
  """(grad(params, x) on one device, the same with x's rows split by position over `mesh`
  under `rules`, that program's compiled HLO text)."""
  want = grad(params, x)
  with sharding.use_mesh(mesh, rules):
    spec = sharding.logical_to_spec(("batch", "activation_length", None), rules, mesh, x.shape)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    return want, grad(params, xs), grad.lower(params, xs).compile().as_text()
