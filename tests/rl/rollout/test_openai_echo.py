"""`/v1/completions` with `echo`: the prompt's own token logprobs, as lm-eval's loglikelihood
(multiple-choice) tasks and scoring services ask for them.

One server for the module: the shipped tiny base (assets/tiny_base, configs/tiny_cpu.py's
train.init_from) behind the HTTP front. The echoed logprobs are checked against the train step's
recompute of the same ids (`rl.train_step.token_logprobs`, the tolerance of
tests/rl/rollout/test_rollout_server.py), and a local multiple-choice task run by lm-eval's own
`local-completions` model (the pinned lm_eval, in a subprocess, offline) picks, for every
question, the option that scoring the options with the model directly picks.
"""
import functools
import glob
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from configs import tiny_cpu
from envs.chat import load_tokenizer
from models import qwen3_5
from rl import params_io
from rl import train_step
from rl.rollout import serve
from rl.rollout.engine_programs import TOP_LOGPROBS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PROMPT = [301, 45, 77, 512, 19, 260, 88, 140, 9, 731, 33, 402]   # ordinary ids of the tiny vocab
ROW = 128  # the recompute's row length

# A multiple-choice task lm-eval reads from a local file (no hub): the tiny base's own world.
QUESTIONS = [
    ("Which tool reads a spreadsheet?", ["spreadsheets_read_sheet", "mail_search_messages",
                                         "calendar_list_events"], 0),
    ("Which tool reads a PDF?", ["chat_read_channel", "pdfs_read_pdf", "documents_read_document"],
     1),
    ("Which tool searches the mail?", ["presentations_read_presentation", "pdfs_read_pdf",
                                       "mail_search_messages"], 2),
    ("What ends an assistant turn?", ["<|im_end|>", "the quick brown fox", "12.5 percent"], 0),
    ("Which file holds the slides?", ["deck.pptx", "report.pdf", "budget.xlsx", "notes.docx"], 0),
    ("What is two plus two?", [" four", " seven", " eleven"], 0),
]
_TASK_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def config():
  c = tiny_cpu.get_config()
  c.unlock()
  c.rollout.slots = 2
  c.rollout.max_len = 512
  c.rollout.prefill_buckets = (32, 128)
  c.rollout.prefix_cache = False
  return c


@pytest.fixture(scope="module")
def params(config):
  return params_io.init_params(config)


@pytest.fixture(scope="module")
def front(config, params):
  server = serve.build_server(config, params=params, port=0, warmup=False)
  f = serve.start_http(server, config, port=0)
  yield f
  f.stop()
  server.stop()


@pytest.fixture(scope="module")
def api(front):
  return openai.OpenAI(base_url=front.url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tok(config):
  return load_tokenizer(config.tokenizer.path, config.tokenizer.special_ids)


@functools.cache
def _recompute(cfg):
  """(token_logprobs as the train step computes them, log_softmax of every position's logits)
  of a [1, ROW] row."""
  def fn(params, tokens):
    lp, _ = train_step.token_logprobs(cfg, params, tokens, 1.0)
    return lp, jax.nn.log_softmax(qwen3_5.forward(cfg, params, tokens), axis=-1)
  return jax.jit(fn)


def _train_step_logprobs(config, params, ids):
  """(logprob of each of `ids` after the ones before it [n] (0 first), the full distribution
  at each position [n, vocab]) by the train step's recompute."""
  tokens = np.zeros((1, ROW), np.int32)
  tokens[0, :len(ids)] = ids
  lp, dist = _recompute(qwen3_5.config_from_dict(config.model))(params, jnp.asarray(tokens))
  n = len(ids)
  return np.asarray(lp[0, :n]), np.concatenate([np.zeros((1, dist.shape[-1])),
                                                np.asarray(dist[0, :n - 1])])


def test_echo_logprobs_equal_the_train_step_recompute_and_top_logprobs_its_likeliest(
    api, config, params, tok):
  r = api.completions.create(model=config.name, prompt=PROMPT, max_tokens=0, echo=True,
                             logprobs=5)
  c = r.choices[0]
  want, dist = _train_step_logprobs(config, params, PROMPT)
  lp = c.logprobs
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None   # no context: as vLLM
  np.testing.assert_allclose(np.asarray(lp.token_logprobs[1:], np.float32), want[1:], atol=1e-4,
                             rtol=0)
  assert lp.tokens == [tok.decode([i]) for i in PROMPT]
  assert c.text == tok.decode(PROMPT)
  assert lp.text_offset == [len(tok.decode(PROMPT[:i])) for i in range(len(PROMPT))]
  for i in range(1, len(PROMPT)):
    best = np.argsort(-dist[i])[:5]
    # The five likeliest and the prompt's own token, by their text (ids that print alike, such
    # as byte tokens, share a key holding the likeliest one's logprob).
    want_alts = {}
    for t in list(best) + [PROMPT[i]]:
      key = tok.decode([int(t)])
      want_alts[key] = max(want_alts.get(key, -np.inf), dist[i, t])
    alts = lp.top_logprobs[i]
    assert set(alts) == set(want_alts), i
    for key, x in want_alts.items():
      assert abs(alts[key] - x) < 1e-4, (i, key)
  assert c.finish_reason == "length"
  assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT), 0)


def test_echo_with_sampled_tokens_is_the_prompt_then_the_same_completion(api, config):
  body = dict(model=config.name, prompt=[PROMPT, PROMPT[:7]], max_tokens=5, temperature=0.0,
              logprobs=1, extra_body={"ignore_eos": True, "return_token_ids": True})
  plain = api.completions.create(**body)
  echoed = api.completions.create(**body, echo=True)
  for p, a, b in zip([PROMPT, PROMPT[:7]], plain.choices, echoed.choices):
    assert b.token_ids == a.token_ids and b.prompt_token_ids == p
    assert b.text.endswith(a.text) and len(b.logprobs.tokens) == len(p) + 5
    assert b.text == "".join(b.logprobs.tokens)
    assert b.logprobs.tokens[len(p):] == a.logprobs.tokens
    assert b.logprobs.token_logprobs[len(p):] == a.logprobs.token_logprobs == [0.0] * 5
    assert b.logprobs.top_logprobs[len(p):] == a.logprobs.top_logprobs
    assert b.logprobs.text_offset[len(p):] == [len(b.text) - len(a.text) + o
                                               for o in a.logprobs.text_offset]
    # Greedy: each sampled token is the prompt position's likeliest, by the scoring program too.
    again = api.completions.create(model=config.name, prompt=p + a.token_ids[:1], max_tokens=0,
                                   echo=True, logprobs=1).choices[0].logprobs
    assert max(again.top_logprobs[-1].values()) == again.token_logprobs[-1]


@pytest.mark.parametrize("body, param", [
    (dict(echo=True, stream=True, max_tokens=1), "echo"),
    (dict(echo=True, max_tokens=1, logprobs=2), "logprobs"),     # alternatives of a sampled token
    (dict(echo=True, max_tokens=0, logprobs=TOP_LOGPROBS + 1), "logprobs"),
    (dict(max_tokens=0), "max_tokens"),                          # nothing to do without echo
    (dict(echo=True, max_tokens=0, prompt=[5000]), None),        # outside the vocabulary
], ids=["stream", "logprobs_2_sampled", "logprobs_21", "max_tokens_0_no_echo", "bad_id"])
def test_echo_requests_the_server_cannot_serve_get_a_400_naming_why(api, config, body, param):
  body = dict(dict(model=config.name, prompt=PROMPT), **body)
  with pytest.raises(openai.BadRequestError) as e:
    api.completions.create(**body)
  assert e.value.body["param"] == param, e.value.body
  assert e.value.body["message"]


def _encode_pair(tok, context: str, continuation: str) -> tuple:
  """(context ids, continuation ids) as lm-eval's `TemplateLM._encode_pair` splits them."""
  whole, ctx = tok.encode(context + continuation), tok.encode(context)
  return ctx, whole[len(ctx):]


def test_lm_eval_local_completions_multiple_choice_picks_what_direct_scoring_picks(
    front, config, params, tok, tmp_path):
  """`lm_eval run --model local-completions` (its loglikelihood path: echo, logprobs 1,
  max_tokens 1, prompts as token-id lists, four a request) on a local YAML task, offline: each
  option's loglikelihood equals the train step's sum over the option's tokens, and the option
  lm-eval picks (acc) is the one with the highest directly computed score."""
  data = tmp_path / "mc.jsonl"
  data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                          for q, c, a in QUESTIONS))
  tasks_dir = tmp_path / "tasks"
  tasks_dir.mkdir()
  (tasks_dir / "tiny_mc.yaml").write_text(_TASK_YAML.format(data=data))
  env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1",
             HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OPENAI_API_KEY="unused")
  model_args = (f"model={config.name},base_url={front.url}/completions,"
                f"tokenizer={os.path.join(ROOT, 'assets', 'tiny_base')},"
                "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
  out = subprocess.run(
      [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
       model_args, "--tasks", "tiny_mc", "--include_path", str(tasks_dir), "--batch_size", "4",
       "--output_path", str(tmp_path / "out"), "--log_samples"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
  [samples_file] = glob.glob(str(tmp_path / "out" / "**" / "samples_tiny_mc_*.jsonl"),
                             recursive=True)
  samples = sorted((json.loads(l) for l in open(samples_file)), key=lambda s: s["doc_id"])
  assert len(samples) == len(QUESTIONS)
  for s, (question, choices, answer) in zip(samples, QUESTIONS):
    context = f"Question: {question}\nAnswer:"
    direct = []
    for choice in choices:
      ctx, cont = _encode_pair(tok, context, " " + choice)
      lp, _ = _train_step_logprobs(config, params, ctx + cont)
      direct.append(float(lp[len(ctx):].sum()))
    served = [float(r[0]) for r in s["filtered_resps"]]
    np.testing.assert_allclose(served, direct, atol=1e-3, rtol=0, err_msg=question)
    picked = int(np.argmax(direct))
    assert s["acc"] == float(picked == answer), (question, served, direct)
    assert int(np.argmax(served)) == picked
    print(f"{question!r}: lm-eval {np.round(served, 3).tolist()}, direct "
          f"{np.round(direct, 3).tolist()}, picked {picked}, answer {answer}")
