"""Worlds: determinism, real files that independent readers open, splits, oracle/null policies."""
import collections
import concurrent.futures
import filecmp
import json
import os
import random
import shutil

import docx
import ml_collections
import openpyxl
import pptx
import pypdf
import pytest

from configs import base
from envs import eval_summary
from envs import scripted_eval
from envs import tasks as tasks_lib
from envs import worlds
from envs.apps import gateway as gateway_lib
from envs.apps import worldstate
from envs.harness import harness_eval
from envs.worlds import render
from envs.worlds import spec as spec_lib
from tests.envs.test_harness_episodes import shared_worlds


@pytest.fixture(scope="session")
def envs_cfg():
  return base.get_config().envs


@pytest.fixture(scope="session")
def worlds_root(envs_cfg):
  return shared_worlds(envs_cfg)


@pytest.fixture(scope="session")
def splits(envs_cfg):
  return {s: tasks_lib.load_split(envs_cfg, s) for s in tasks_lib.SPLITS}


def _all_files(root):
  out = []
  for d, dirs, names in os.walk(root):
    dirs.sort()
    out += [os.path.relpath(os.path.join(d, n), root) for n in sorted(names)]
  return out


def test_same_seed_gives_identical_bytes(envs_cfg, tmp_path):
  spec = worlds.spec_for(envs_cfg, "corporate_law", 1)
  worlds.generate_world(envs_cfg, spec, str(tmp_path / "a"))
  worlds.generate_world(envs_cfg, spec, str(tmp_path / "b"))
  fa, fb = _all_files(tmp_path / "a"), _all_files(tmp_path / "b")
  assert fa == fb and len(fa) > 50
  _, mismatch, errors = filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", fa, shallow=False)
  assert not mismatch and not errors
  # A different seed must change the facts, not just file order.
  other = envs_cfg.copy_and_resolve_references()
  other.seed = envs_cfg.seed + 1
  spec2 = worlds.spec_for(other, "corporate_law", 1)
  assert spec2["entities"][0]["series"] != spec["entities"][0]["series"]


def test_world_count_and_contents(envs_cfg, worlds_root):
  specs = worlds.all_specs(envs_cfg)
  assert len(specs) == 3 * envs_cfg.worlds_per_domain == 33
  for wid in specs:
    files = _all_files(os.path.join(worlds_root, wid))
    exts = collections.Counter(os.path.splitext(f)[1] for f in files)
    n_ent = envs_cfg.entities_per_world + envs_cfg.distractor_entities_per_world
    assert exts[".pdf"] == n_ent and exts[".docx"] == n_ent and exts[".pptx"] == 1
    assert exts[".xlsx"] == n_ent + 1  # + the summary workbook
    assert {"apps/mail.json", "apps/chat.json", "apps/calendar.json"} <= set(files)
    assert len(files) == 3 * n_ent + 2 + envs_cfg.note_files_per_world + 3
  # The spec (answers) never lands inside a world.
  any_spec = next(iter(specs.values()))
  for f in _all_files(os.path.join(worlds_root, any_spec["world_id"], "files")):
    assert not f.endswith("spec.json")


@pytest.mark.parametrize("domain", worlds.DOMAINS)
def test_files_open_with_independent_readers_and_hold_facts(envs_cfg, worlds_root, domain):
  spec = worlds.spec_for(envs_cfg, domain, 2)
  root = os.path.join(worlds_root, spec["world_id"])
  v = spec_lib.VOCAB[domain]
  deck = pptx.Presentation(os.path.join(root, "files", render.deck_path(spec)))
  deck_text = "\n".join(sh.text_frame.text for s in deck.slides for sh in s.shapes if sh.has_text_frame)
  mail = json.load(open(os.path.join(root, "apps", "mail.json")))
  chat = json.load(open(os.path.join(root, "apps", "chat.json")))
  for e in spec["entities"]:
    p = {k: os.path.join(root, "files", x) for k, x in render.entity_paths(spec, e).items()}
    text = "\n".join(pg.extract_text() for pg in pypdf.PdfReader(p["pdf"]).pages)
    for attr, val in e["profile"].items():
      assert f"{attr.capitalize()}: {spec_lib.fmt_value(val, attr)}" in text
    ws = openpyxl.load_workbook(p["xlsx"], data_only=True)[v["sheet"]]
    rows = {r[0]: r[1:5] for r in ws.iter_rows(values_only=True) if r and r[0] in e["series"]}
    for metric, vals in e["series"].items():
      assert list(rows[metric]) == pytest.approx([vals[y] for y in spec_lib.YEARS])
    paras = "\n".join(x.text for x in docx.Document(p["docx"]).paragraphs)
    for attr, val in e["terms"].items():
      assert f"{attr.capitalize()}: {spec_lib.fmt_value(val, attr)}" in paras
    for attr, val in e["slide"].items():
      assert f"{attr.capitalize()}: {spec_lib.fmt_value(val, attr)}" in deck_text
    assert any(e["mail_fact"]["body"] in m["body"] for m in mail["messages"])
    assert any(e["chat_fact"]["text"] == m["text"] for m in chat["channels"][e["chat_fact"]["channel"]])


def test_split_sizes_and_disjointness(envs_cfg, splits):
  tr, ev = splits["train"], splits["eval"]
  assert len(tr) == envs_cfg.train_tasks == 1928
  assert len(ev) == 3 * envs_cfg.eval_tasks_per_domain == 480
  assert collections.Counter(t.domain for t in ev) == {d: 160 for d in worlds.DOMAINS}
  assert max(collections.Counter(t.domain for t in tr).values()) - \
      min(collections.Counter(t.domain for t in tr).values()) <= 1
  assert not {t.world_id for t in tr} & {t.world_id for t in ev}
  assert not {t.prompt for t in tr} & {t.prompt for t in ev}
  for ts in (tr, ev):
    assert len({t.prompt for t in ts}) == len(ts)
    assert len({t.id for t in ts}) == len(ts)
  for t in tr + ev:
    assert 1 <= len(t.rubric) <= 10
    assert t.level in (1, 2, 3)
  for d in worlds.DOMAINS:
    for ts in (tr, ev):
      assert {t.level for t in ts if t.domain == d} == {1, 2, 3}
  # Level 1 is a single lookup; higher levels chain several calls.
  assert all(len(t.oracle_steps) == 1 for t in tr + ev if t.level == 1)
  assert all(len(t.oracle_steps) >= 2 for t in tr + ev if t.level > 1)
  # Level 3 always ends with an action in an app.
  actions = {"mail_send_message", "spreadsheets_write_cell", "calendar_create_event",
             "chat_post_message", "presentations_add_slide", "code_execution_run_python"}
  assert all(t.oracle_steps[-1]["name"] in actions for t in tr + ev if t.level == 3)


def test_splits_are_deterministic_and_serialisable(envs_cfg, splits):
  again = tasks_lib.load_split(envs_cfg, "eval")
  assert [t.to_json() for t in again] == [t.to_json() for t in splits["eval"]]
  t = splits["eval"][7]
  assert tasks_lib.Task.from_json(t.to_json()) == t
  src = tasks_lib.TaskSource(splits["eval"])
  assert len(src) == 480 and tasks_lib.Task.from_json(src[3]) == splits["eval"][3]


def test_grain_loader_yields_tasks(envs_cfg):
  seen = [t.id for t in tasks_lib.data_loader(envs_cfg, "eval", seed=3)]
  assert sorted(seen) == sorted(t.id for t in tasks_lib.load_split(envs_cfg, "eval"))
  assert seen != sorted(seen)  # shuffled


def _by_domain(outcomes):
  out = collections.defaultdict(list)
  for o in outcomes:
    out[o.domain].append(o)
  return out


def _null_then_oracle(args):
  """Runs, per task of one world, the null episode then the oracle episode (in-process tools)."""
  cfg_dict, root, work, task_jsons = args
  envs_cfg = ml_collections.ConfigDict(cfg_dict)
  ts = [tasks_lib.Task.from_json(j) for j in task_jsons]
  inst = worldstate.WorldInstance(os.path.join(root, ts[0].world_id), work)
  gw = gateway_lib.LocalGateway(inst.path, envs_cfg)
  out = [(scripted_eval.run_episode(t, gw, inst, envs_cfg, "null"),
          scripted_eval.run_episode(t, gw, inst, envs_cfg, "oracle")) for t in ts]
  inst.close()
  return out


# The train split's 1928 tasks are slow (`make test-all`, CI; ~75 s here): the eval split's 480
# stay in the quick suite.
@pytest.mark.parametrize("split", [pytest.param(s, marks=pytest.mark.slow) if s == "train" else s
                                   for s in tasks_lib.SPLITS])
def test_oracle_solves_and_null_fails_every_task_in_process(envs_cfg, worlds_root, splits, split,
                                                             tmp_path):
  """Grading logic over the whole split, tools called in-process (the MCP path is tested below).

  One working copy per world, reset before each episode; worlds spread over two processes.
  """
  by_world = collections.defaultdict(list)
  for t in splits[split]:
    by_world[t.world_id].append(t.to_json())
  jobs = [(envs_cfg.to_dict(), worlds_root, str(tmp_path / w), ts) for w, ts in by_world.items()]
  with concurrent.futures.ProcessPoolExecutor(2) as ex:
    pairs = [p for res in ex.map(_null_then_oracle, jobs) for p in res]
  null, oracle = [p[0] for p in pairs], [p[1] for p in pairs]
  bad = [(o.task_id, o.errors, o.criteria) for o in oracle if not o.passed or o.errors]
  assert not bad, bad[:5]
  assert len(oracle) == len(splits[split])
  for d, os_ in _by_domain(null).items():
    assert sum(o.passed for o in os_) == 0, d
    assert sum(o.reward for o in os_) / len(os_) < 0.2


def _sample(ts, per_cell, seed=0):
  """per_cell tasks of each (domain, level), all from the first world of the domain."""
  rng = random.Random(seed)
  first = {}
  for t in ts:
    first.setdefault(t.domain, t.world_id)
  cells = collections.defaultdict(list)
  for t in ts:
    if t.world_id == first[t.domain]:
      cells[(t.domain, t.level)].append(t)
  return [t for k in sorted(cells) for t in rng.sample(cells[k], per_cell)]


def test_oracle_and_null_through_real_mcp_gateways_sample(envs_cfg, worlds_root, splits):
  sample = _sample(splits["eval"], 3) + _sample(splits["train"], 2, seed=1)
  oracle = scripted_eval.run_tasks(sample, envs_cfg, "oracle", "mcp", 2, worlds_root)
  assert all(o.passed and not o.errors for o in oracle), [(o.task_id, o.errors) for o in oracle
                                                         if not o.passed or o.errors]
  assert {o.domain for o in oracle} == set(worlds.DOMAINS)
  assert {o.level for o in oracle} == {1, 2, 3}
  null = scripted_eval.run_tasks(sample, envs_cfg, "null", "mcp", 2, worlds_root)
  assert not any(o.passed for o in null)


def test_oracle_notices_a_corrupted_world(envs_cfg, worlds_root, splits, tmp_path):
  """The oracle checks facts in tool output: change a document and it must notice."""
  t = next(t for t in splits["eval"] if t.family == "xlsx_lookup")
  bad_root = tmp_path / "root"
  shutil.copytree(os.path.join(worlds_root, t.world_id), bad_root / t.world_id)
  path = bad_root / t.world_id / "files" / t.oracle_steps[0]["args"]["path"].lstrip("/")
  render.write_xlsx(str(path), {"Financials": [["Metric", "FY2021"], ["Revenue", 1]],
                                "KPIs": [["x"]], "Matter": [["x"]]})
  out = scripted_eval.run_tasks([t], envs_cfg, "oracle", "local", 1, str(bad_root))
  assert "oracle_expectation" in out[0].errors
  # And a wrong final answer fails the rubric.
  wrong = tasks_lib.Task(**{**t.__dict__, "oracle_answer": "12345678"})
  out = scripted_eval.run_tasks([wrong], envs_cfg, "oracle", "local", 1, worlds_root)
  assert not out[0].passed and out[0].reward == 0.0


def test_eval_main_prints_json_last_line(envs_cfg, worlds_root, capsys):
  cfg = base.get_config()
  cfg.envs.worlds_root = worlds_root
  cfg.eval.max_tasks = 12
  cfg.eval.transport = "local"
  cfg.policy = "null"
  scripted_eval.main(cfg)
  last = capsys.readouterr().out.strip().splitlines()[-1]
  out = json.loads(last)
  assert set(out) == {"pass_at_1", "mean_reward", "by_domain", "errors"}
  assert out["pass_at_1"] == 0.0


def test_eval_main_hands_the_model_policy_to_the_harness_eval(monkeypatch):
  """config.policy=model runs through the agent harness (envs/harness/harness_eval.py), with the
  job's split of the work."""
  calls = []
  monkeypatch.setattr(harness_eval, "main",
                      lambda config, flags=None, split=None: calls.append((config, split)) or {})
  cfg = base.get_config()
  cfg.policy = "model"
  split = object()
  assert scripted_eval.main(cfg, split=split) == {}
  assert calls == [(cfg, split)]


@pytest.mark.slow
def test_full_splits_through_real_mcp(envs_cfg, worlds_root, splits):
  """Acceptance: oracle pass@1 = 100% and null = 0% on both splits, by domain, over MCP."""
  for split in tasks_lib.SPLITS:
    ts = splits[split]
    for policy, want in (("oracle", 1.0), ("null", 0.0)):
      outs = scripted_eval.run_tasks(ts, envs_cfg, policy, "mcp", 4, worlds_root)
      s = eval_summary.summarize(outs, ts, 200, domain_of=lambda o: o.domain,
                                 errors=scripted_eval.error_counts(outs))
      print(split, policy, json.dumps(s))
      for o in outs:
        if o.errors:
          print("  ", o.task_id, o.errors, o.detail)
      assert len(outs) == len(ts)
      for d, v in s["by_domain"].items():
        assert v["pass_at_1"] == want, (split, policy, d, v)
      assert not s["errors"], s["errors"]
