"""`launch.py --mode=serve` serves the config's checkpoint and says so; a random init only when
asked (`--weights=random`); a config that names no checkpoint is refused in one line."""
import os
import re
import subprocess
import sys
import time

import numpy as np
import openai
import pytest
import torch
import transformers

from configs import tiny_cpu
from configs.validate import ConfigError
from rl import params_io
from rl.rollout import serve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BASE = os.path.join(ROOT, "assets", "tiny_base")
PROMPT = [301, 45, 77, 512, 19, 260, 88, 140, 9, 731, 33, 402]   # ordinary ids of the tiny vocab
NEW = 12
SMALL = ["--config.rollout.warmup=False", "--config.rollout.max_len=1024",
         "--config.train.max_context=1024", "--config.rollout.prefill_buckets=(32,)",
         "--config.rollout.prefix_cache=False", "--config.rollout.slots=2"]


def _hf_greedy(path, prompt, n):
  """`n` greedy ids after `prompt` by transformers' generate on the checkpoint at `path`."""
  model = transformers.AutoModelForCausalLM.from_pretrained(path)
  model.eval()
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, attention_mask=torch.ones((1, len(prompt)), dtype=int))
  return out[0, len(prompt):].tolist()


def _serve(extra, log):
  """A `launch.py --mode=serve` process on configs/tiny_cpu.py (free ports) and its OpenAI URL
  and printed lines, once it serves."""
  p = subprocess.Popen([sys.executable, "launch.py", "--mode=serve",
                        "--config=configs/tiny_cpu.py", "--port=0", "--http_port=0"]
                       + SMALL + extra, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
  deadline = time.monotonic() + 300
  while True:
    with open(log.name) as f:
      text = f.read()
    if "serving on" in text:
      return p, re.search(r"\((http://localhost:\d+/v1),", text).group(1), text
    assert p.poll() is None, "launch.py exited before serving:\n" + text[-3000:]
    assert time.monotonic() < deadline, text[-3000:]
    time.sleep(0.2)


@pytest.mark.parametrize("extra, start", [
    ([], BASE + " (train.init_from)"),
    (["--weights=random"], "a random init (seed 0; --weights=random)"),
], ids=["config_checkpoint", "random_when_asked"])
def test_serve_on_tiny_cpu_answers_with_the_weights_it_says_it_serves(tmp_path, extra, start):
  """Greedy ids over HTTP equal transformers' generate on assets/tiny_base exactly when the
  server says it serves that checkpoint (the default for configs/tiny_cpu.py); a random init,
  asked for, answers otherwise."""
  with open(tmp_path / "serve.log", "w") as log:
    p, url, text = _serve(extra, log)
    try:
      assert f"serving weights: {start}\n" in text, text[-2000:]
      api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
      r = api.completions.create(model="tiny_cpu", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                 extra_body={"return_token_ids": True, "ignore_eos": True})
      served = r.choices[0].token_ids
    finally:
      p.terminate()
      p.wait(60)
  reference = _hf_greedy(BASE, PROMPT, NEW)
  assert (served == reference) == (not extra), (served, reference)


def test_a_config_with_no_checkpoint_is_refused_in_one_line_unless_random_is_asked():
  c = tiny_cpu.get_config()
  c.unlock()
  c.train.init_from = ""
  with pytest.raises(ConfigError, match="--weights=random"):
    serve.load_weights(c)
  assert serve.load_weights(c, "random")[0] is None
  c.rollout.weights_dir = "/tmp/published"   # a trainer will publish: a placeholder until then
  params, what = serve.load_weights(c)
  assert params is None and what.endswith("until the first version published in /tmp/published")
  out = subprocess.run([sys.executable, "launch.py", "--mode=serve", "--config=configs/tiny_cpu.py",
                        "--config.train.init_from=", "--port=0"] + SMALL,
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
  assert "no weights to serve" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_weights_dir_flag_serves_that_checkpoint(tmp_path):
  """--weights=DIR reads that Hugging Face directory (here the shipped base by another path)."""
  c = tiny_cpu.get_config()
  c.unlock()
  c.train.init_from = ""
  link = tmp_path / "base"
  os.symlink(BASE, link)
  params, what = serve.load_weights(c, str(link))
  assert what == f"{link} (--weights)"
  want = params_io.init_params(tiny_cpu.get_config())
  np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(want["embed"]))
  with pytest.raises(ConfigError, match="is not a directory"):
    serve.load_weights(c, str(tmp_path / "missing"))
