"""Deterministic agent worlds: specs (facts) and their rendering to real files.

  specs = all_specs(config.envs)                 # cheap, in memory
  root = ensure_worlds(config.envs)              # renders once into config.envs.worlds_root
  world_dir(root, "in03")                        # -> <root>/in03 (files/ + apps/)
"""
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from concurrent import futures

from envs.worlds import render
from envs.worlds import spec as spec_lib

DOMAINS = spec_lib.DOMAINS
_MANIFEST = "manifest.json"
# Bumped when the rendering changes, so cached worlds from older code are rebuilt.
GENERATOR_VERSION = 1


def spec_for(envs_cfg, domain: str, index: int) -> dict:
  return spec_lib.build_spec(domain, index, envs_cfg.seed, envs_cfg.entities_per_world,
                             envs_cfg.distractor_entities_per_world, envs_cfg.people_per_world)


def all_specs(envs_cfg) -> dict:
  """world_id -> spec for every world (worlds_per_domain in each domain)."""
  out = {}
  for d in DOMAINS:
    for i in range(envs_cfg.worlds_per_domain):
      s = spec_for(envs_cfg, d, i)
      out[s["world_id"]] = s
  return out


def world_dir(root: str, wid: str) -> str:
  return os.path.join(root, wid)


def _fingerprint(envs_cfg) -> str:
  keys = ("seed", "worlds_per_domain", "entities_per_world", "distractor_entities_per_world",
          "people_per_world", "note_files_per_world")
  d = {k: envs_cfg[k] for k in keys}
  d["version"] = GENERATOR_VERSION
  # The generator's own source is part of the key: a cached world never outlives its code.
  here = os.path.dirname(os.path.abspath(__file__))
  for name in ("spec.py", "render.py"):
    with open(os.path.join(here, name), "rb") as f:
      d[name] = hashlib.sha256(f.read()).hexdigest()
  return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def generate_world(envs_cfg, spec: dict, out_dir: str):
  """Renders one world into out_dir (replacing it), atomically via a sibling temp dir."""
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp_" + spec["world_id"])
  render.render_world(spec, tmp, envs_cfg.note_files_per_world)
  if os.path.exists(out_dir):
    shutil.rmtree(out_dir)
  os.rename(tmp, out_dir)


def _gen_one(args):
  envs_cfg, wid, root = args
  domain = {d[:2]: d for d in DOMAINS}[wid[:2]]
  generate_world(envs_cfg, spec_for(envs_cfg, domain, int(wid[2:])), world_dir(root, wid))
  return wid


def cache_dir(envs_cfg, parent: str) -> str:
  """A directory under parent named by the generation settings (for shared caches)."""
  return os.path.join(parent, f"worlds-{_fingerprint(envs_cfg)}")


def ensure_worlds(envs_cfg, root: str = None, workers: int = None) -> str:
  """Renders every world under root (default envs_cfg.worlds_root) unless a manifest shows
  they were already rendered from the same settings. Returns root."""
  root = os.path.abspath(root or envs_cfg.worlds_root)
  fp = _fingerprint(envs_cfg)
  man = os.path.join(root, _MANIFEST)
  if _rendered(man, fp):
    return root
  os.makedirs(root, exist_ok=True)
  # Several processes of one job on one machine (scripts/local_pod.py) share the root: the first
  # to take the lock renders, the others then find the manifest.
  with open(os.path.join(root, ".render.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not _rendered(man, fp):
      _render(envs_cfg, root, fp, man, workers)
  return root


def _rendered(man: str, fp: str) -> bool:
  if not os.path.exists(man):
    return False
  with open(man) as f:
    return json.load(f).get("fingerprint") == fp


def _render(envs_cfg, root: str, fp: str, man: str, workers) -> None:
  wids = sorted(all_specs(envs_cfg))
  workers = workers or envs_cfg.generation_workers
  jobs = [(envs_cfg, w, root) for w in wids]
  if workers > 1:
    with futures.ProcessPoolExecutor(workers) as ex:
      list(ex.map(_gen_one, jobs))
  else:
    for j in jobs:
      _gen_one(j)
  with open(man, "w") as f:
    json.dump(dict(fingerprint=fp, worlds=wids), f)
