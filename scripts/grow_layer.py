"""Appends a layer to a Hugging Face Qwen3.5 checkpoint without changing what the model computes.

  python scripts/grow_layer.py --src assets/tiny_base --dst runs/grown/hf [--copy_layer 3]

The new last layer is a copy of layer `--copy_layer` (its type, norms, projections, router and
experts) whose output projections are zero: attention `o_proj` / Gated DeltaNet `out_proj` and
every `down_proj` (routed experts, shared expert, dense MLP). Both residual branches of the new
layer then add exactly zero, so the grown model's logits equal the source's, and training
starts from the source's function with the new layer's capacity to fill (its output
projections get gradients at once, the rest as soon as those are non-zero).

Train the result with the grown layer list in the config, e.g. for the tiny default
  --config.model.num_hidden_layers=5
  --config.model.layer_types="('linear_attention','linear_attention','linear_attention','full_attention','full_attention')"
(docs/experiments/tiny_base.md, "Stronger bases, and a fifth layer", has the measured run).
"""
import argparse
import glob
import json
import os
import re

from safetensors.numpy import load_file
from safetensors.numpy import save_file

LAYER_PREFIX = "model.language_model.layers."
_ZEROED = re.compile(r"(^|\.)(o_proj|out_proj|down_proj)(\.weight)?$")


def grow(src: str, dst: str, copy_layer: int = -1) -> dict:
  """Writes the grown checkpoint to `dst`; returns its text config."""
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  text = config.get("text_config", config)
  n = int(text["num_hidden_layers"])
  layer_types = list(text["layer_types"])
  if not -n <= copy_layer < n:
    raise ValueError(f"--copy_layer must name one of the {n} layers of {src}")
  copy_layer %= n
  files = sorted(glob.glob(os.path.join(src, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors in {src}")
  tensors = {}
  for path in files:
    tensors.update(load_file(path))
  src_prefix, new_prefix = f"{LAYER_PREFIX}{copy_layer}.", f"{LAYER_PREFIX}{n}."
  copied = 0
  for key in [k for k in tensors if k.startswith(src_prefix)]:
    value = tensors[key].copy()
    if _ZEROED.search(key[len(src_prefix):]):
      value[...] = 0
    tensors[new_prefix + key[len(src_prefix):]] = value
    copied += 1
  if not copied:
    raise ValueError(f"{src} has no tensor under {src_prefix!r}")
  text["num_hidden_layers"] = n + 1
  text["layer_types"] = layer_types + [layer_types[copy_layer]]
  os.makedirs(dst, exist_ok=True)
  save_file(tensors, os.path.join(dst, "model.safetensors"))
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(config, f, indent=1)
  return text


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--src", required=True, help="Hugging Face checkpoint directory to grow")
  p.add_argument("--dst", required=True, help="directory for the grown checkpoint")
  p.add_argument("--copy_layer", type=int, default=-1, help="layer to copy (default: the last)")
  a = p.parse_args()
  text = grow(a.src, a.dst, a.copy_layer)
  print(f"{a.dst}: {text['num_hidden_layers']} layers {tuple(text['layer_types'])}")


if __name__ == "__main__":
  main()
