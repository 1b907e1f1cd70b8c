"""scripts/grow_layer.py: the grown checkpoint computes what its source computes."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base
from models import qwen3_5

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import grow_layer  # noqa: E402


def _saved_source(tmp_path):
  """One layer cycle (3 DeltaNet + 1 attention) of the tiny model, saved in the hub layout."""
  m = base.get_model_config()
  m.update(num_hidden_layers=4)
  cfg = qwen3_5.config_from_dict(m)
  params = jax.jit(qwen3_5.init_params, static_argnums=0)(cfg, jax.random.key(0))
  return cfg, params, qwen3_5.save_hf(cfg, params, str(tmp_path / "src"))


@pytest.mark.parametrize("copy_layer,new_type", [(3, "full_attention"), (0, "linear_attention")])
def test_grown_checkpoint_gives_the_source_logits_with_one_more_layer(tmp_path, copy_layer,
                                                                       new_type):
  cfg, params, src = _saved_source(tmp_path)
  grow_layer.grow(src, str(tmp_path / "grown"), copy_layer)
  cfg5, params5 = qwen3_5.load_hf(str(tmp_path / "grown"))
  assert cfg5.num_hidden_layers == 5 and cfg5.layer_types[-1] == new_type
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)), jnp.int32)
  want = qwen3_5.forward(cfg, params, tokens)
  got = qwen3_5.forward(cfg5, params5, tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)


def test_layer_out_of_range_is_a_clear_error(tmp_path):
  _, _, src = _saved_source(tmp_path)
  with pytest.raises(ValueError, match="copy_layer"):
    grow_layer.grow(src, str(tmp_path / "grown"), 4)
