"""Builds the tiny byte-level BPE tokenizer shipped as envs/chat/tiny_tokenizer.json.

  python scripts/build_tokenizer.py [--out envs/chat/tiny_tokenizer.json] [--vocab_size 1024]

The corpus is generated here, deterministically, in the language of the agent worlds
(management consulting, investment banking, corporate law), plus the chat template, Qwen3-Coder
XML tool calls and JSON tool schemas, so that the few merges a 1024-entry vocabulary affords go
to the text the tiny model actually sees. The pipeline mirrors Qwen's (NFC, the Qwen2 split
regex, byte-level BPE) and the special tokens are those of Qwen3.5, at small ids (0..8).
Running it twice gives a byte-identical file.
"""
import argparse
import json
import os
import random
import sys

from tokenizers import Regex
from tokenizers import Tokenizer
from tokenizers import decoders
from tokenizers import models
from tokenizers import normalizers
from tokenizers import pre_tokenizers
from tokenizers import trainers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs.chat import template  # noqa: E402
from envs.chat.tokenizer import TINY_SPECIAL_IDS  # noqa: E402

# Qwen2/Qwen3 pre-tokenizer split pattern.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_COMPANIES = ["Northwind", "Contoso", "Fabrikam", "Globex", "Initech", "Umbrella", "Stark",
              "Wayne", "Acme", "Hooli", "Vandelay", "Tyrell", "Cyberdyne", "Soylent", "Wonka"]
_SUFFIX = ["Holdings", "Capital", "Partners", "Group", "LLC", "Inc.", "plc", "GmbH"]
_PEOPLE = ["Alice Chen", "Bob Martin", "Carla Diaz", "David Okafor", "Emma Rossi", "Farid Haddad",
           "Grace Kim", "Hugo Lefevre", "Ines Silva", "James Patel", "Kenji Sato", "Laura Novak"]
_CONSULTING = [
    "market sizing", "customer churn", "EBITDA margin", "operating model", "cost reduction",
    "go-to-market strategy", "pricing study", "due diligence", "benchmarking", "synergy case",
    "steering committee", "workstream", "key findings", "recommendation", "revenue growth"]
_BANKING = [
    "discounted cash flow", "WACC", "terminal value", "enterprise value", "LBO model",
    "comparable companies", "precedent transactions", "EV/EBITDA multiple", "net debt",
    "free cash flow", "pitch book", "term sheet", "leverage ratio", "IRR", "equity value"]
_LAW = [
    "indemnification", "governing law", "limitation of liability", "termination for convenience",
    "confidentiality", "non-compete", "force majeure", "assignment clause", "representations and "
    "warranties", "master services agreement", "non-disclosure agreement", "board resolution",
    "change of control", "material adverse effect", "dispute resolution"]
_TOOLS = [
    ("filesystem_list", {"path": "string"}), ("filesystem_read", {"path": "string"}),
    ("documents_read", {"path": "string"}), ("pdfs_read", {"path": "string", "page": "integer"}),
    ("spreadsheets_read_range", {"path": "string", "sheet": "string", "range": "string"}),
    ("spreadsheets_write_cell", {"path": "string", "sheet": "string", "cell": "string",
                                 "value": "number"}),
    ("presentations_read", {"path": "string"}), ("mail_search", {"query": "string"}),
    ("mail_send", {"to": "string", "subject": "string", "body": "string"}),
    ("chat_read_channel", {"channel": "string"}), ("chat_post", {"channel": "string",
                                                                 "text": "string"}),
    ("calendar_list_events", {"date": "string"}),
    ("calendar_create_event", {"title": "string", "start": "string", "attendees": "array"}),
    ("code_execution_run", {"code": "string"})]


def _company(rng):
  return f"{rng.choice(_COMPANIES)} {rng.choice(_SUFFIX)}"


def _number(rng):
  kind = rng.randrange(4)
  if kind == 0:
    return f"{rng.randrange(1, 999)}.{rng.randrange(10)}%"
  if kind == 1:
    return f"${rng.randrange(1, 9999):,}.{rng.randrange(100):02d}m"
  if kind == 2:
    return f"{rng.randrange(1, 99)}.{rng.randrange(10)}x"
  return f"{rng.randrange(100, 999_999):,}"


def _date(rng):
  return f"20{rng.randrange(20, 30)}-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}"


def _path(rng):
  folder = rng.choice(["reports", "models", "decks", "contracts", "memos", "data"])
  ext = rng.choice(["pdf", "xlsx", "pptx", "docx", "txt", "csv"])
  return f"/{folder}/{rng.choice(_COMPANIES).lower()}_{rng.choice(['q1', 'q2', 'fy24', 'draft', 'final'])}.{ext}"


def _sentence(rng):
  domain = rng.choice([_CONSULTING, _BANKING, _LAW])
  c, p, t = _company(rng), rng.choice(_PEOPLE), rng.choice(domain)
  forms = [
      f"The {t} for {c} shows {_number(rng)} as of {_date(rng)}.",
      f"{p} asked for the {t} of {c} before the meeting on {_date(rng)}.",
      f"Please review the {t} in {_path(rng)} and send the figure to {p}.",
      f"Under the {t}, {c} shall notify the counterparty within {rng.randrange(5, 90)} days.",
      f"What is the {t} reported by {c} for fiscal year 20{rng.randrange(18, 26)}?",
      f"According to the memo, the {t} increased from {_number(rng)} to {_number(rng)}.",
      f"{c} agreed that the {t} applies to all affiliates and subsidiaries.",
      f"The answer is {_number(rng)}.",
      f"I will read {_path(rng)} to find the {t}.",
      f"The {t} is on sheet {rng.choice(['Summary', 'DCF', 'Inputs', 'Comps'])}, cell "
      f"{rng.choice('BCDEFG')}{rng.randrange(2, 60)}.",
  ]
  return rng.choice(forms)


def _tool_call_text(rng):
  name, params = rng.choice(_TOOLS)
  parts = ["<tool_call>\n", f"<function={name}>\n"]
  for arg, kind in params.items():
    if kind == "integer":
      value = str(rng.randrange(1, 40))
    elif kind == "number":
      value = str(round(rng.uniform(0, 9999), 2))
    elif kind == "array":
      value = json.dumps([f"{p.split()[0].lower()}@{rng.choice(_COMPANIES).lower()}.com"
                          for p in rng.sample(_PEOPLE, 2)])
    elif arg == "path":
      value = _path(rng)
    else:
      value = _sentence(rng)
    parts.append(f"<parameter={arg}>\n{value}\n</parameter>\n")
  parts.append("</function>\n</tool_call>")
  return "".join(parts)


def _tool_schemas():
  tools = []
  for name, params in _TOOLS:
    props = {k: {"type": v, "description": f"The {k} argument."} for k, v in params.items()}
    tools.append({"type": "function", "function": {
        "name": name, "description": f"{name.replace('_', ' ').capitalize()}.",
        "parameters": {"type": "object", "properties": props, "required": list(params)}}})
  return tools


def corpus(seed=0, n_docs=3000):
  """Yields the training documents, deterministically from `seed`."""
  rng = random.Random(seed)
  tools = _tool_schemas()
  system = template.tools_system_text(tools, "")
  for _ in range(20):
    yield system
  for i in range(n_docs):
    kind = i % 4
    if kind == 0:
      yield " ".join(_sentence(rng) for _ in range(rng.randrange(3, 9)))
    elif kind == 1:
      yield "\n".join([_sentence(rng), _tool_call_text(rng)])
    elif kind == 2:
      record = {"file": _path(rng), "company": _company(rng), "value": _number(rng),
                "date": _date(rng), "owner": rng.choice(_PEOPLE)}
      yield "<tool_response>\n" + json.dumps(record) + "\n</tool_response>"
    else:
      yield ("<think>\n" + _sentence(rng) + " " + _sentence(rng) + "\n</think>\n\n"
             + _sentence(rng))


def build(vocab_size=1024, seed=0):
  """Trains and returns the tokenizer."""
  specials = [tok for tok, _ in sorted(TINY_SPECIAL_IDS.items(), key=lambda kv: kv[1])]
  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=2, special_tokens=specials, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(corpus(seed), trainer=trainer)
  for content, want in TINY_SPECIAL_IDS.items():
    got = tok.token_to_id(content)
    if got != want:
      raise RuntimeError(f"special token {content} landed at id {got}, expected {want}")
  if tok.get_vocab_size() != vocab_size:
    raise RuntimeError(f"vocabulary has {tok.get_vocab_size()} entries, expected {vocab_size}")
  return tok


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join("envs", "chat", "tiny_tokenizer.json"))
  parser.add_argument("--vocab_size", type=int, default=1024)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  tok = build(args.vocab_size, args.seed)
  # Compact, key-sorted JSON keeps the committed file small and diffs stable.
  text = json.dumps(json.loads(tok.to_str()), ensure_ascii=False, separators=(",", ":"),
                    sort_keys=False)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(text)
  print(f"wrote {args.out}: {tok.get_vocab_size()} tokens, {len(text)} bytes")


if __name__ == "__main__":
  main()
