"""The embedded default: a tiny Qwen3.5 MoE that trains on a 2-core CPU in minutes."""
from configs import base


def get_config(arg=None):
  del arg
  c = base.get_config()
  c.name = "tiny_cpu"
  return c
