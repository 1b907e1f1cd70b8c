"""Our chat format against Qwen3.5's published Jinja chat template, token for token.

Each conversation is rendered twice: by `tokenizer.apply_chat_template` (transformers, the
published template as exports carry it in tokenizer_config.json) and by `ChatFormat.render_ids`.
Where our format differs on purpose, the test builds the published rendering from ours by
exactly the documented change (docs/hf_export.md, "Where our chat format differs") and checks
that this, and nothing else, is the difference:

  A. Past reasoning is kept. The template drops the `<think>...</think>` block of assistant
     turns at or before the last user query; we keep every turn's, so a conversation only ever
     grows at its end (what token-in/token-out rollouts and their training need).
  B. Tool-call arguments that are booleans or null are written as JSON (`true`, `null`); the
     template's `string` filter writes Python's `True` / `None`, which JSON tools and our
     parser would take for strings.
  C. A system message with no text and no tools adds no system turn; the template writes an
     empty one.
"""
import hashlib

import pytest
import transformers

from envs.chat import ChatFormat
from envs.chat import hf_export
from envs.chat import load_tokenizer
from envs.chat import template

TOOLS = [
    {"type": "function", "function": {
        "name": "pdfs_read_pdf", "description": "Read a PDF.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "first_page": {"type": "integer"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "mail_send_message", "description": "Send an e-mail (ünïcode ok).",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "array", "items": {"type": "string"}}, "subject": {"type": "string"},
            "body": {"type": "string"}, "urgent": {"type": "boolean"}},
            "required": ["to", "body"]}}},
]
SYSTEM = {"role": "system", "content": "You are an analyst. Answer briefly."}
TASK = {"role": "user", "content": "What was EBITDA in FY2024 according to /reports/a.pdf?"}


def _call(name, **arguments):
  return {"name": name, "arguments": arguments}


def _agent_episode(reasoning: bool):
  r = (lambda s: s) if reasoning else (lambda s: "")
  return [
      SYSTEM, TASK,
      {"role": "assistant", "reasoning_content": r("I should read the report."), "content": "",
       "tool_calls": [_call("pdfs_read_pdf", path="/reports/a.pdf", first_page=2)]},
      {"role": "tool", "content": "EBITDA FY2024: 412.5\nEBITDA FY2023: 380.0"},
      {"role": "assistant", "reasoning_content": r("Tell Kim, then answer."),
       "content": "Sending it on.",
       "tool_calls": [_call("mail_send_message", to=["kim@x.com"], body="EBITDA 412.5\nthanks"),
                      _call("pdfs_read_pdf", path="/reports/b.pdf")]},
      {"role": "tool", "content": "sent"},
      {"role": "tool", "content": "  nothing new  "},
      {"role": "assistant", "reasoning_content": r("Done."), "content": "412.5"},
  ]


# name -> (messages, tools, thinking, add_generation_prompt): rendered alike by both.
SAME = {
    "user_only_thinking": ([TASK], (), True, True),
    "user_only_no_thinking": ([TASK], (), False, True),
    "system_and_user": ([SYSTEM, TASK], (), True, True),
    "tools_without_system_prompt": ([TASK], TOOLS, False, True),
    "tools_and_system_prompt": ([SYSTEM, TASK], TOOLS, True, True),
    "one_call_and_result_no_thinking": (_agent_episode(False)[:4], TOOLS, False, True),
    "one_call_and_result_thinking": (_agent_episode(True)[:4], TOOLS, True, True),
    "content_then_two_calls_two_results": (_agent_episode(True)[:7], TOOLS, True, True),
    "whole_episode_thinking": (_agent_episode(True), TOOLS, True, False),
    "whole_episode_no_thinking": (_agent_episode(False), TOOLS, False, False),
    "argument_types_and_unicode": ([
        {"role": "user", "content": "  Mail Zoë the table, café style. \n"},
        {"role": "assistant", "reasoning_content": "", "content": "",
         "tool_calls": [_call("mail_send_message", to=["zoë@x.com", "b@y.org"],
                              subject="Q3 — 日本語", body="line 1\n  line 2\n",
                              meta={"rows": [1, 2.5, -3e-05], "note": "ok"}, count=7,
                              ratio=0.25)]},
        {"role": "tool", "content": "\nsent to 2 recipients\n"},
    ], TOOLS, False, True),
    "many_tool_rounds_one_query": ([SYSTEM, TASK] + [
        m for i in range(3) for m in (
            {"role": "assistant", "reasoning_content": f"step {i}", "content": "",
             "tool_calls": [_call("pdfs_read_pdf", path=f"/r/{i}.pdf")]},
            {"role": "tool", "content": f"page {i}"})], TOOLS, True, True),
}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
  """(our tokenizer, the transformers tokenizer an export of it gives)."""
  ours = load_tokenizer()
  d = tmp_path_factory.mktemp("tok")
  hf_export.write(str(d), ours, ours.vocab_size, 4096)
  return ours, transformers.AutoTokenizer.from_pretrained(str(d))


def _published(hf, messages, tools, thinking, gen):
  kw = dict(tools=list(tools) or None, add_generation_prompt=gen, enable_thinking=thinking)
  text = hf.apply_chat_template(messages, tokenize=False, **kw)
  ids = hf.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"]
  return text, list(ids)


def test_the_template_is_the_published_one_verbatim(toks):
  text = hf_export.qwen3_5_chat_template()
  assert hashlib.sha256(text.encode()).hexdigest() == hf_export.QWEN3_5_CHAT_TEMPLATE_SHA256
  assert toks[1].chat_template == text


@pytest.mark.parametrize("name", sorted(SAME))
def test_published_template_renders_our_ids(toks, name):
  ours, hf = toks
  messages, tools, thinking, gen = SAME[name]
  fmt = ChatFormat(ours, thinking=thinking)
  text, ids = _published(hf, messages, tools, thinking, gen)
  assert text == template.render_text(messages, tools, gen, thinking)
  assert ids == fmt.render_ids(messages, tools, add_generation_prompt=gen)


def test_difference_a_past_reasoning_is_kept(toks):
  ours, hf = toks
  first = {"role": "assistant", "reasoning_content": "Look it up.", "content": "",
           "tool_calls": [_call("pdfs_read_pdf", path="/reports/a.pdf")]}
  answer = {"role": "assistant", "reasoning_content": "It says 412.5.", "content": "412.5"}
  messages = [SYSTEM, TASK, first, {"role": "tool", "content": "EBITDA: 412.5"}, answer,
              {"role": "user", "content": "And in FY2023?"}]
  text, ids = _published(hf, messages, TOOLS, True, True)
  mine = template.render_text(messages, TOOLS, True, True)
  # Exactly the two think blocks before the last user query are what the template leaves out.
  dropped = mine.replace("<think>\nLook it up.\n</think>\n\n", "", 1).replace(
      "<think>\nIt says 412.5.\n</think>\n\n", "", 1)
  assert mine != text and dropped == text
  assert ids == ours.encode(dropped)
  # After the last user query both keep them: the case of every agent episode we train on.
  assert _published(hf, messages[:5], TOOLS, True, False)[0] == template.render_text(
      messages[:5], TOOLS, False, True)


def test_difference_b_boolean_and_null_arguments_are_json(toks):
  ours, hf = toks
  messages = [TASK, {"role": "assistant", "reasoning_content": "", "content": "",
                     "tool_calls": [_call("mail_send_message", to=["k@x.com"], body="hi",
                                          urgent=True, cc=None)]}]
  text, ids = _published(hf, messages, TOOLS, False, False)
  mine = template.render_text(messages, TOOLS, False, False)
  assert "<parameter=urgent>\ntrue\n</parameter>\n<parameter=cc>\nnull\n</parameter>" in mine
  assert mine.replace("\ntrue\n", "\nTrue\n").replace("\nnull\n", "\nNone\n") == text
  assert ids == ours.encode(text)


def test_difference_c_empty_system_message_adds_no_turn(toks):
  ours, hf = toks
  messages = [{"role": "system", "content": "  "}, TASK]
  text, ids = _published(hf, messages, (), True, True)
  mine = template.render_text(messages, (), True, True)
  assert text == "<|im_start|>system\n<|im_end|>\n" + mine
  assert ids == ours.encode(text)
