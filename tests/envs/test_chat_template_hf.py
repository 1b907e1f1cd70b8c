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

Exports carry the published template with one addition (envs/chat/hf_export.py,
`with_json_string_arguments`): tool-call arguments given as a JSON string, the OpenAI wire
form, render as the same arguments given as a mapping (the published template raises a
TypeError on a string).
"""
import json

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


def test_the_template_is_the_published_one_verbatim_with_json_string_arguments_added(toks):
  text = hf_export.qwen3_5_chat_template()
  assert hashlib.sha256(text.encode()).hexdigest() == hf_export.QWEN3_5_CHAT_TEMPLATE_SHA256
  exported = toks[1].chat_template
  assert exported == hf_export.with_json_string_arguments(text) != text
  assert hf_export.with_json_string_arguments(exported) == exported   # applied once
  # The published template, less the prepended macros and the one branch added for strings.
  elif_ = "{%- elif tool_call.arguments is defined %}"
  branch = exported[exported.index("{%- if tool_call.arguments is defined and"):]
  branch = branch[:branch.index(elif_) + len(elif_)]
  assert exported[exported.index("{%- set image_count"):].replace(
      branch, "{%- if tool_call.arguments is defined %}") == text
  with pytest.raises(TypeError, match="mapping"):   # what a string did before
    transformers.AutoTokenizer.from_pretrained(
        toks[1].name_or_path, chat_template=text).apply_chat_template(
            _with_arguments('{"path": "/a.pdf"}'), tokenize=False)


def _with_arguments(arguments):
  """A conversation whose one tool call (OpenAI's form) carries `arguments` as given."""
  return [TASK, {"role": "assistant", "content": "", "tool_calls": [
      {"id": "call_1", "type": "function",
       "function": {"name": "mail_send_message", "arguments": arguments}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "sent"}]


# Every kind of value, and text a JSON writer escapes (quotes, backslashes, newlines, tabs,
# non-ASCII within and beyond the BMP).
ARGUMENTS = {"to": ["zoë@x.com", "b@y.org"], "subject": 'Q3 — 日本語 "quoted" \\ a/b',
             "body": "line 1\n  line 2\n\ttab 😀", "count": 7, "neg": -12, "ratio": 0.25,
             "whole": 2.0, "tiny": -3e-05, "huge": 1e20, "big": 12345678901234567890,
             "urgent": True, "cc": None, "empty_text": "", "empty": {}, "none_here": [],
             "meta": {"rows": [1, 2.5, -3e-05, True, None], "note": "é", "deep": {"x": [[]]}}}


@pytest.mark.parametrize("dumps", [
    dict(), dict(ensure_ascii=False), dict(separators=(",", ":")), dict(indent=2)],
    ids=["json_dumps", "ensure_ascii_false", "compact", "indented"])
def test_json_string_arguments_render_the_same_tokens_as_the_mapping(toks, dumps):
  """transformers' apply_chat_template on the exported template: arguments as a JSON string
  (however a client wrote it) give the ids of the same arguments as a mapping; our own
  rendering (ChatFormat.render_ids) reads the string as that mapping too."""
  ours, hf = toks
  as_mapping = _published(hf, _with_arguments(ARGUMENTS), TOOLS, False, True)
  as_string = _published(hf, _with_arguments(json.dumps(ARGUMENTS, **dumps)), TOOLS, False, True)
  assert as_string == as_mapping
  assert "<parameter=body>\nline 1\n  line 2\n\ttab 😀\n</parameter>" in as_mapping[0]
  fmt = ChatFormat(ours, thinking=False)
  assert fmt.render_ids(_with_arguments(json.dumps(ARGUMENTS, **dumps)), TOOLS) == (
      fmt.render_ids(_with_arguments(ARGUMENTS), TOOLS))


def test_empty_json_string_arguments_render_as_no_arguments(toks):
  _, hf = toks
  none = _published(hf, _with_arguments({}), TOOLS, False, True)
  assert _published(hf, _with_arguments("{}"), TOOLS, False, True) == none
  assert _published(hf, _with_arguments(""), TOOLS, False, True) == none


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
