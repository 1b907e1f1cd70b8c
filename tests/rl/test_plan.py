"""Memory planner (launch.py --mode=plan): the attention-score term follows the attention
strategy the model config picks."""
import pytest

from configs import tiny_cpu
from models import qwen3_5
from rl import plan


def _scores(**model):
  mc = qwen3_5.config_from_dict(tiny_cpu.get_config().model).replace(
      attention_query_chunk=0, attention_causal_block=0)
  return plan.activation_bytes(mc.replace(**model), 2048, 4.0, 1)["attn_scores"]


def test_causal_blocks_hold_the_lower_triangle_of_scores():
  full = _scores()
  # 2048 / 512 = 4 blocks: (4 + 1) / (2 * 4) of the square.
  assert _scores(attention_causal_block=512) == pytest.approx(full * 5 / 8)
  assert _scores(attention_causal_block=4096) == full     # one block: the whole square


def test_query_chunks_hold_one_block_of_scores():
  assert _scores(attention_query_chunk=256) == pytest.approx(_scores() / 8)
  # The query-chunked path takes precedence when both are set (as in the model).
  assert _scores(attention_query_chunk=256, attention_causal_block=512) == \
      _scores(attention_query_chunk=256)
