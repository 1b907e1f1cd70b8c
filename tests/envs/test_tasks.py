"""Rubric criteria: numbers in free text, before/after diffs, and that wrong work fails."""
import shutil

import pytest

from configs import base
from envs import tasks as tasks_lib
from envs import worlds
from envs.apps import tools as tools_lib
from envs.tasks import rubric


@pytest.fixture(scope="module")
def cfg():
  return base.get_config().envs


def test_numbers_in_free_text():
  assert rubric.numbers_in("Revenue was $1,234.5m in FY2024, up 12% (-3.5 pts)") == [1234.5, 12.0, -3.5]
  assert rubric.numbers_in("no figures") == []


@pytest.mark.parametrize("text,ok", [("1234.5", True), ("about 1,234.5", True), ("1234.6", False),
                                     ("1,235", False), ("", False), ("1 2 3 4 5 6 7 8 9 1234.5", False)])
def test_number_matching(text, ok, cfg):
  assert rubric.number_matches(text, 1234.5, 1, 1e-5, cfg.max_numbers_in_answer) == ok


def test_sign_free_and_tolerance(cfg):
  assert rubric.number_matches("fell 5.2%", -5.2, 1, 0.0, 8, sign_free=True)
  assert not rubric.number_matches("fell 5.2%", -5.2, 1, 0.0, 8)
  assert rubric.number_matches("12.34", 12.3, 1, cfg.answer_rel_tol, 8)


def test_dates_in_words_or_iso():
  c = dict(type="answer_date", date="2025-03-07")
  cfg = base.get_config().envs
  for s, ok in (("2025-03-07", True), ("March 7, 2025", True), ("7 March 2025", True),
                ("March 8, 2025", False)):
    assert rubric.check(c, s, "", "", cfg).passed == ok


@pytest.fixture()
def two_worlds(cfg, tmp_path):
  spec = worlds.spec_for(cfg, "corporate_law", 9)
  before = str(tmp_path / "before")
  worlds.generate_world(cfg, spec, before)
  after = str(tmp_path / "after")
  shutil.copytree(before, after)
  return spec, before, after


def _task(rub):
  return tasks_lib.Task(id="t", split="eval", domain="corporate_law", world_id="co09", level=3,
                        family="x", prompt="p", input_files={}, rubric=tuple(rub), oracle_steps=(),
                        oracle_answer="")


def test_mail_criteria_follow_the_diff(cfg, two_worlds):
  spec, before, after = two_worlds
  who = spec["people"][2]["email"]
  rub = [dict(type="mail_sent", to=who, contains=[{"number": 42.5, "decimals": 1}]),
         dict(type="mail_sent", to=who, subject="Fees", contains=[]),
         dict(type="mail_count", n=1)]
  g = rubric.grade(_task(rub), "", before, after, cfg)
  assert g.reward == 0 and not g.passed
  t = tools_lib.WorldTools(after, cfg)
  t.mail_send_message([spec["people"][3]["email"]], "Fees", "42.5")  # wrong person
  g = rubric.grade(_task(rub), "", before, after, cfg)
  assert [r.passed for r in g.results] == [False, False, True]
  t.mail_send_message([who], "Fees update", "The figure is 42.5.")
  g = rubric.grade(_task(rub), "", before, after, cfg)
  assert [r.passed for r in g.results] == [True, True, False] and g.reward == pytest.approx(2 / 3)


def test_state_criteria(cfg, two_worlds):
  spec, before, after = two_worlds
  t = tools_lib.WorldTools(after, cfg)
  deck = "/" + worlds.render.deck_path(spec)
  rub = [dict(type="cell_value", path="/summary/summary_workbook.xlsx", sheet="Summary", cell="B3",
              value=7.5, decimals=1),
         dict(type="slide_added", path=deck, title="Update", contains=[{"number": 99, "decimals": 0}]),
         dict(type="event_booked", title="Prep", date="2025-05-06", start="10:00", attendees=[]),
         dict(type="chat_posted", channel="#general", contains=[{"text": "done"}]),
         dict(type="file_contains", path="outputs/x.txt", contains=[{"number": 3.25, "decimals": 2}]),
         dict(type="unchanged", path="/summary/summary_workbook.xlsx")]
  g = rubric.grade(_task(rub), "", before, after, cfg)
  assert [r.passed for r in g.results] == [False] * 5 + [True]
  t.spreadsheets_write_cell("/summary/summary_workbook.xlsx", "Summary", "B3", "7.5")
  t.presentations_add_slide(deck, "Q3 Update", ["Exposure 99"])
  t.calendar_create_event("Prep call", "2025-05-06", "10:00", 30, [])
  t.chat_post_message("#general", "All done")
  t.filesystem_write_text_file("/outputs/x.txt", "3.25\n")
  g = rubric.grade(_task(rub), "", before, after, cfg)
  assert [r.passed for r in g.results] == [True] * 5 + [False]


def test_judge_criterion_needs_an_endpoint(cfg):
  with pytest.raises(rubric.JudgeUnavailable):
    rubric.grade(_task([dict(type="judge", instruction="Is it polite?")]), "hi", "", "", cfg)


def test_every_rubric_type_in_the_splits_is_known(cfg):
  known = {"answer_number", "answer_text", "answer_date", "mail_sent", "mail_count", "cell_value",
           "file_contains", "slide_added", "event_booked", "event_count", "chat_posted", "unchanged"}
  seen = {c["type"] for s in tasks_lib.SPLITS for t in tasks_lib.load_split(cfg, s) for c in t.rubric}
  assert seen <= known and {"mail_sent", "cell_value", "event_booked", "slide_added"} <= seen
