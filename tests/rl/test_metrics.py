"""The run's figures: metrics.jsonl keeps every key as given; TensorBoard tags name the phase once."""
import glob
import json
import os
import struct

from tensorboardX.proto import event_pb2

from rl import metrics


def _tags(tb_dir):
  """Every scalar tag in the TensorBoard event files under tb_dir (TFRecord framing)."""
  tags = set()
  for path in glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      tags.update(v.tag for v in event.summary.value)
      pos += 12 + n + 4
  return tags


def test_tensorboard_tags_never_repeat_the_phase(tmp_path):
  m = metrics.Metrics(str(tmp_path), tensorboard=True)
  # What the RL step writes: the step's own keys, some of which already carry their phase.
  m.write(1, "train", {"loss": 0.5, "train/draws": 2.0, "train/live_rows": 8.0,
                       "train/informative_groups_drawn": 3.0, "rollout/longest_tokens": 900.0})
  m.write(1, "eval", {"pass_at_1": 0.25, "eval/episodes": 480.0})
  m.close()
  assert _tags(os.path.join(tmp_path, "tb")) == {
      "train/loss", "train/draws", "train/live_rows", "train/informative_groups_drawn",
      "train/rollout/longest_tokens", "eval/pass_at_1", "eval/episodes"}
  with open(os.path.join(tmp_path, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  assert rows[0]["phase"] == "train" and rows[0]["train/draws"] == 2.0 and rows[0]["loss"] == 0.5


def test_tensorboard_tag():
  assert metrics.tensorboard_tag("train", "train/draws") == "train/draws"
  assert metrics.tensorboard_tag("train", "draws") == "train/draws"
  assert metrics.tensorboard_tag("train", "trainer/x") == "train/trainer/x"
  assert metrics.tensorboard_tag("sft", "train/x") == "sft/train/x"
