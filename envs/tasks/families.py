"""Task families: each turns a world spec into task instances with rubric and oracle.

A family is a function (spec, rng) -> candidate dict or None:
  {family, level, prompt, rubric[], oracle{steps[], answer}, input_files{}}
Oracle steps are tool calls {name, args, expect[]}: `expect` lists facts the tool's output
must show ({"number": v} or {"text": s}); the oracle fails loudly when a world does not
surface a fact its task needs. The oracle's final answer is computed from the spec.

Levels: 1 = one named file/app, one lookup, answer; 2 = find the sources yourself, chain
lookups across files/apps and compute; 3 = level-2 work plus an action in an app (send an
e-mail, write a cell, book a meeting, post in chat, add a slide, write a file with code).
"""
import random

from envs.worlds import render
from envs.worlds import spec as spec_lib

Y = spec_lib.YEARS


def _v(spec):
  return spec_lib.VOCAB[spec["domain"]]


def _ents(spec):
  return [e for e in spec["entities"] if not e["distractor"]]


def _intro(spec):
  v = _v(spec)
  return f"You work on Project {spec['project']} ({v['label']} {v['team']}). "


def _dec(x) -> int:
  if isinstance(x, int):
    return 0
  s = repr(float(x))
  return len(s.split(".")[1]) if "." in s and not s.endswith(".0") else 0


def _unit(spec, metric: str) -> str:
  if "(" in metric or metric in ("Headcount", "Hours"):
    return ""
  return f" (in {_v(spec)['unit']})"


def _num(c):
  return {"number": c, "decimals": _dec(c)}


def _answer_crit(value, attr: str, decimals: int = None, sign_free: bool = False):
  if isinstance(value, (int, float)):
    return dict(type="answer_number", value=value, sign_free=sign_free,
                decimals=_dec(value) if decimals is None else decimals,
                description=f"States the {attr}: {spec_lib.fmt_value(value, attr)}")
  return dict(type="answer_text", text=str(value), description=f"States the {attr}: {value}")


def _find(spec, e, kind):
  """Oracle step that locates an entity's document by searching file names."""
  path = render.entity_paths(spec, e)[kind]
  return dict(name="filesystem_search_files", args={"pattern": f"*{e['slug']}*.{kind}"},
              expect=[{"text": "/" + path}])


def _read_xlsx(spec, e, numbers):
  path = render.entity_paths(spec, e)["xlsx"]
  return dict(name="spreadsheets_read_sheet", args={"path": "/" + path, "sheet": _v(spec)["sheet"]},
              expect=[{"number": n} for n in numbers])


def _read_doc(spec, e, kind, values):
  path = "/" + render.entity_paths(spec, e)[kind]
  name = {"pdf": "pdfs_read_pdf", "docx": "documents_read_document"}[kind]
  return dict(name=name, args={"path": path}, expect=[_expect(v) for v in values])


def _expect(v):
  return {"number": v} if isinstance(v, (int, float)) else {"text": str(v)}


def _person(spec, exclude=()):
  return [p for p in spec["people"][1:] if p["name"] not in exclude]


# ---------------------------------------------------------------------------------- level 1 ---
def f_xlsx_lookup(spec, rng):
  e = rng.choice(_ents(spec))
  metric = rng.choice(list(e["series"]))
  year = rng.choice(Y)
  val = e["series"][metric][year]
  path = "/" + render.entity_paths(spec, e)["xlsx"]
  return dict(level=1, family="xlsx_lookup",
              prompt=_intro(spec) + f"Open {path}. What was {e['name']}'s {metric} in {year}"
              f"{_unit(spec, metric)}? Reply with the figure.",
              rubric=[_answer_crit(val, f"{metric} {year}")],
              oracle=dict(steps=[_read_xlsx(spec, e, [val])], answer=f"{spec_lib.fmt_value(val)}"))


def _doc_lookup(spec, rng, kind, table_key, family):
  e = rng.choice(_ents(spec))
  attr = rng.choice([a for a in e[table_key]])
  val = e[table_key][attr]
  path = "/" + render.entity_paths(spec, e)[kind]
  return dict(level=1, family=family,
              prompt=_intro(spec) + f"According to {path}, what is the {attr} of {e['name']}?",
              rubric=[_answer_crit(val, attr)],
              oracle=dict(steps=[_read_doc(spec, e, kind, [val])],
                          answer=f"The {attr} is {spec_lib.fmt_value(val, attr)}."))


def f_pdf_lookup(spec, rng):
  return _doc_lookup(spec, rng, "pdf", "profile", "pdf_lookup")


def f_docx_lookup(spec, rng):
  return _doc_lookup(spec, rng, "docx", "terms", "docx_lookup")


def f_pptx_lookup(spec, rng):
  e = rng.choice(_ents(spec))
  attr = rng.choice(list(e["slide"]))
  val = e["slide"][attr]
  path = "/" + render.deck_path(spec)
  return dict(level=1, family="pptx_lookup",
              prompt=_intro(spec) + f"In the deck {path}, what {attr} is shown for {e['name']}?",
              rubric=[_answer_crit(val, attr)],
              oracle=dict(steps=[dict(name="presentations_read_presentation", args={"path": path},
                                      expect=[_expect(val)])],
                          answer=f"{spec_lib.fmt_value(val, attr)}"))


def f_mail_lookup(spec, rng):
  e = rng.choice(_ents(spec))
  m = e["mail_fact"]
  return dict(level=1, family="mail_lookup",
              prompt=_intro(spec) + f"{m['sender']} e-mailed you about {e['name']}. What "
              f"{m['label']} did they give?",
              rubric=[_answer_crit(m["value"], m["label"])],
              oracle=dict(steps=[dict(name="mail_search_messages", args={"query": e["name"]},
                                      expect=[_expect(m["value"])])],
                          answer=f"{spec_lib.fmt_value(m['value'])}"))


def f_chat_lookup(spec, rng):
  e = rng.choice(_ents(spec))
  c = e["chat_fact"]
  return dict(level=1, family="chat_lookup",
              prompt=_intro(spec) + f"What {c['label']} for {e['name']} was announced in the "
              f"{c['channel']} chat channel? Give the date.",
              rubric=[dict(type="answer_date", date=c["value"],
                           description=f"States the {c['label']}: {c['value']}")],
              oracle=dict(steps=[dict(name="chat_read_channel", args={"channel": c["channel"]},
                                      expect=[{"text": c["value"]}])],
                          answer=c["value"]))


def f_calendar_lookup(spec, rng):
  i = rng.randrange(len(_ents(spec)))
  ev = spec["events"][i]
  return dict(level=1, family="calendar_lookup",
              prompt=_intro(spec) + f"On which date is the meeting '{ev['title']}' in your "
              "calendar, and at what time does it start?",
              rubric=[dict(type="answer_date", date=ev["date"], description=f"Date {ev['date']}"),
                      dict(type="answer_text", text=ev["start"], description=f"Start {ev['start']}")],
              oracle=dict(steps=[dict(name="calendar_list_events", args={},
                                      expect=[{"text": ev["title"]}, {"text": ev["date"]}])],
                          answer=f"{ev['date']} at {ev['start']}"))


# ---------------------------------------------------------------------------------- level 2 ---
def _growth(spec, rng):
  e = rng.choice(_ents(spec))
  metric = rng.choice(list(e["series"]))
  y1, y2 = sorted(rng.sample(range(len(Y)), 2))
  a, b = e["series"][metric][Y[y1]], e["series"][metric][Y[y2]]
  pct = round((b / a - 1) * 100, 1)
  steps = [_find(spec, e, "xlsx"), _read_xlsx(spec, e, [a, b])]
  what = f"the percentage change in {e['name']}'s {metric} from {Y[y1]} to {Y[y2]}"
  return e, metric, (Y[y1], Y[y2]), pct, steps, what


def f_growth(spec, rng):
  e, metric, ys, pct, steps, what = _growth(spec, rng)
  return dict(level=2, family="growth",
              prompt=_intro(spec) + f"What was {what}? Round to one decimal place.",
              rubric=[_answer_crit(pct, "percentage change", 1, sign_free=True)],
              oracle=dict(steps=steps, answer=f"{pct}%"))


def f_sum(spec, rng):
  ents = rng.sample(_ents(spec), 3)
  metric = rng.choice(list(ents[0]["series"]))
  year = rng.choice(Y)
  vals = [e["series"][metric][year] for e in ents]
  total = round(sum(vals), max(_dec(x) for x in vals))
  v = _v(spec)
  use_input = rng.random() < 0.5
  steps, files = [], {}
  if use_input:
    name = f"inputs/request_{spec_lib.slugify(metric)}_{year}_{'_'.join(e['slug'][:6] for e in ents)}.txt"
    files[name] = "Please total these:\n" + "\n".join(e["name"] for e in ents) + "\n"
    who = f"the {v['entity_kind']}s listed in the attached file /{name}"
    steps.append(dict(name="filesystem_read_text_file", args={"path": "/" + name},
                      expect=[{"text": e["name"]} for e in ents]))
  else:
    who = f"{ents[0]['name']}, {ents[1]['name']} and {ents[2]['name']}"
  for e, val in zip(ents, vals):
    steps += [_find(spec, e, "xlsx"), _read_xlsx(spec, e, [val])]
  return dict(level=2, family="sum", input_files=files,
              prompt=_intro(spec) + f"What was the combined {metric} of {who} in {year}"
              f"{_unit(spec, metric)}?",
              rubric=[_answer_crit(total, f"combined {metric}")],
              oracle=dict(steps=steps, answer=f"{spec_lib.fmt_value(total)}"))


def f_max(spec, rng):
  ents = rng.sample(_ents(spec), 4)
  metric = rng.choice(list(ents[0]["series"]))
  year = rng.choice(Y)
  best = max(ents, key=lambda e: e["series"][metric][year])
  val = best["series"][metric][year]
  steps = []
  for e in ents:
    steps += [_find(spec, e, "xlsx"), _read_xlsx(spec, e, [e["series"][metric][year]])]
  names = ", ".join(e["name"] for e in ents[:-1]) + f" and {ents[-1]['name']}"
  return dict(level=2, family="max",
              prompt=_intro(spec) + f"Which of {names} had the highest {metric} in {year}? "
              "Give its name and the figure.",
              rubric=[dict(type="answer_text", text=best["name"], description=f"Names {best['name']}"),
                      _answer_crit(val, f"{metric} {year}")],
              oracle=dict(steps=steps, answer=f"{best['name']}: {spec_lib.fmt_value(val)}"))


# Cross-source quantities per domain: (description, sources, compute). Sources are
# (kind, key) pairs: ("mail", None), ("terms", attr), ("profile", attr), ("series", metric).
def _cross(spec, rng):
  """A quantity combining two sources (e-mail, DOCX, PDF, XLSX) of one entity."""
  e = rng.choice(_ents(spec))
  d = spec["domain"]
  steps = []
  if d == "investment_banking":
    kind = rng.choice(("mcap", "rev_per_emp"))
    if kind == "mcap":
      price, shares = e["mail_fact"]["value"], e["terms"]["diluted shares (m)"]
      val = round(price * shares, 1)
      what = (f"{e['name']}'s market capitalisation in $m, using the closing share price e-mailed "
              f"to you and the diluted share count in its diligence memo (one decimal)")
      steps += [dict(name="mail_search_messages", args={"query": e["name"]}, expect=[_expect(price)]),
                _find(spec, e, "docx"), _read_doc(spec, e, "docx", [shares])]
    else:
      rev, emp = e["series"]["Revenue"]["FY2024"], e["profile"]["employees"]
      val = round(rev * 1000 / emp, 1)
      what = (f"{e['name']}'s FY2024 revenue per employee in $k, using the revenue in its "
              f"financial model and the headcount in its annual report (one decimal)")
      steps += [_find(spec, e, "xlsx"), _read_xlsx(spec, e, [rev]), _find(spec, e, "pdf"),
                _read_doc(spec, e, "pdf", [emp])]
  elif d == "management_consulting":
    kind = rng.choice(("savings_share", "market_share"))
    year = "FY2024"
    rev = e["series"]["Revenue"][year]
    if kind == "savings_share":
      tgt = e["terms"]["savings target ($m)"]
      val = round(tgt / rev * 100, 1)
      what = (f"the savings target in the {e['name']} interview notes as a percentage of the "
              f"unit's {year} revenue (one decimal)")
      steps += [_find(spec, e, "docx"), _read_doc(spec, e, "docx", [tgt])]
    else:
      size = e["profile"]["market size ($m)"]
      val = round(rev / size * 100, 1)
      what = (f"{e['name']}'s share of its market in percent: its {year} revenue divided by the "
              f"market size in its market report (one decimal)")
      steps += [_find(spec, e, "pdf"), _read_doc(spec, e, "pdf", [size])]
    steps += [_find(spec, e, "xlsx"), _read_xlsx(spec, e, [rev])]
  else:
    kind = rng.choice(("cap_use", "fees_vs_damages"))
    if kind == "cap_use":
      offer, cap = e["mail_fact"]["value"], e["terms"]["liability cap ($k)"]
      val = round(offer / cap * 100, 1)
      what = (f"the settlement offer e-mailed about {e['name']} as a percentage of the liability "
              f"cap in the {e['name']} master agreement (one decimal)")
      steps += [dict(name="mail_search_messages", args={"query": e["name"]}, expect=[_expect(offer)]),
                _find(spec, e, "docx"), _read_doc(spec, e, "docx", [cap])]
    else:
      fees, dmg = e["series"]["Fees billed"]["FY2024"], e["profile"]["damages claimed ($m)"]
      val = round(fees / (dmg * 1000) * 100, 2)
      what = (f"the FY2024 fees billed on {e['name']} (billing workbook, $k) as a percentage of the "
              f"damages claimed in its complaint ($m) (two decimals)")
      steps += [_find(spec, e, "xlsx"), _read_xlsx(spec, e, [fees]), _find(spec, e, "pdf"),
                _read_doc(spec, e, "pdf", [dmg])]
  decimals = 2 if "(two decimals)" in what else 1
  return e, kind, val, decimals, steps, what


def f_cross(spec, rng):
  e, kind, val, dec, steps, what = _cross(spec, rng)
  return dict(level=2, family=f"cross_{kind}",
              prompt=_intro(spec) + f"Compute {what}.",
              rubric=[_answer_crit(val, kind, dec)],
              oracle=dict(steps=steps, answer=f"{val}"))


# ---------------------------------------------------------------------------------- level 3 ---
def f_email_figure(spec, rng):
  if rng.random() < 0.5:
    e, kind, val, dec, steps, what = _cross(spec, rng)
    topic = kind.replace("_", " ")
  else:
    e, metric, ys, val, steps, what = _growth(spec, rng)
    dec, topic = 1, f"{metric.lower()} growth"
    what += " (one decimal)"
  p = rng.choice(_person(spec))
  subject = f"{spec['project']} - {e['name']} {topic}"
  steps = [dict(name="mail_list_contacts", args={}, expect=[{"text": p["email"]}])] + steps
  body = f"Hi {p['name'].split()[0]},\n\nThe figure is {val}.\n\nBest regards"
  steps.append(dict(name="mail_send_message",
                    args={"to": [p["email"]], "subject": subject, "body": body}, expect=[]))
  return dict(level=3, family="email_figure",
              prompt=_intro(spec) + f"Compute {what}, then e-mail the figure to {p['name']} "
              f"({p['role']}) with the subject '{subject}'. Tell me the figure in your reply too.",
              rubric=[dict(type="mail_sent", to=p["email"], contains=[{"number": val, "decimals": dec}],
                           description=f"E-mail to {p['name']} states {val}"),
                      dict(type="mail_sent", to=p["email"], subject=subject, contains=[],
                           description="The e-mail has the requested subject"),
                      dict(type="mail_count", n=1, description="Exactly one e-mail was sent"),
                      _answer_crit(val, topic, dec, sign_free="growth" in topic)],
              oracle=dict(steps=steps, answer=f"The figure is {val}; I e-mailed it to {p['name']}."))


def f_write_cell(spec, rng):
  e, metric, ys, pct, steps, what = _growth(spec, rng)
  row = spec["entities"].index(e) + 2
  path = "/" + render.SUMMARY_PATH
  src = render.entity_paths(spec, e)["xlsx"]
  steps.append(dict(name="spreadsheets_write_cell",
                    args={"path": path, "sheet": render.SUMMARY_SHEET, "cell": f"B{row}",
                          "value": str(pct)}, expect=[]))
  return dict(level=3, family="write_cell",
              prompt=_intro(spec) + f"Compute {what} (in percent, one decimal) and record it in "
              f"the Result column of {e['name']}'s row on the '{render.SUMMARY_SHEET}' sheet of "
              f"{path}. Leave the source workbook untouched.",
              rubric=[dict(type="cell_value", path=path, sheet=render.SUMMARY_SHEET, cell=f"B{row}",
                           value=pct, decimals=1, sign_free=False,
                           description=f"{path} B{row} holds {pct}"),
                      dict(type="unchanged", path=src, description="Source workbook unchanged")],
              oracle=dict(steps=steps, answer=f"Recorded {pct}% in B{row}."))


def f_book_meeting(spec, rng):
  e = rng.choice(_ents(spec))
  c = e["chat_fact"]
  p1, p2 = rng.sample(_person(spec), 2)
  start = f"{rng.randint(9, 16):02d}:{rng.choice(('00', '30'))}"
  dur = rng.choice((30, 45, 60))
  title = f"{e['name']} {c['label']} prep"
  steps = [dict(name="chat_read_channel", args={"channel": c["channel"]}, expect=[{"text": c["value"]}]),
           dict(name="mail_list_contacts", args={}, expect=[{"text": p1["email"]}, {"text": p2["email"]}]),
           dict(name="calendar_create_event",
                args={"title": title, "date": c["value"], "start": start, "duration_min": dur,
                      "attendees": [p1["email"], p2["email"]]}, expect=[])]
  return dict(level=3, family="book_meeting",
              prompt=_intro(spec) + f"Book a {dur}-minute meeting titled '{title}' with "
              f"{p1['name']} and {p2['name']}, starting at {start} on the day of the {c['label']} "
              f"for {e['name']} that was announced in {c['channel']}.",
              rubric=[dict(type="event_booked", title=title, date=c["value"], start=start,
                           attendees=[], description=f"'{title}' booked on {c['value']} at {start}"),
                      dict(type="event_booked", title=title, date=c["value"], start=start,
                           attendees=[p1["email"], p2["email"]], description="Both attendees invited"),
                      dict(type="event_booked", title=title, date=c["value"], start=start,
                           duration_min=dur, attendees=[], description=f"Lasts {dur} minutes"),
                      dict(type="event_count", n=1, description="Exactly one event was added")],
              oracle=dict(steps=steps, answer=f"Booked '{title}' on {c['value']} at {start}."))


def f_post_chat(spec, rng):
  e = rng.choice(_ents(spec))
  metric = rng.choice(list(e["series"]))
  year = rng.choice(Y)
  val = e["series"][metric][year]
  ch = _v(spec)["chat_fact"][1]
  steps = [_find(spec, e, "xlsx"), _read_xlsx(spec, e, [val]),
           dict(name="chat_post_message",
                args={"channel": ch, "text": f"{e['name']} {metric} {year}: {val}"}, expect=[])]
  return dict(level=3, family="post_chat",
              prompt=_intro(spec) + f"Post {e['name']}'s {year} {metric}{_unit(spec, metric)} in "
              f"the {ch} channel, naming the {_v(spec)['entity_kind']}.",
              rubric=[dict(type="chat_posted", channel=ch, contains=[_num(val)],
                           description=f"A new {ch} message gives {val}"),
                      dict(type="chat_posted", channel=ch, contains=[{"text": e["name"]}],
                           description=f"The message names {e['name']}")],
              oracle=dict(steps=steps, answer="Posted."))


def f_add_slide(spec, rng):
  e = rng.choice(_ents(spec))
  metric = rng.choice(list(e["series"]))
  year = rng.choice(Y)
  val = e["series"][metric][year]
  path = "/" + render.deck_path(spec)
  title = f"{e['name']} {metric} update"
  steps = [_find(spec, e, "xlsx"), _read_xlsx(spec, e, [val]),
           dict(name="presentations_add_slide",
                args={"path": path, "title": title, "bullets": [f"{metric} {year}: {val}"]},
                expect=[])]
  return dict(level=3, family="add_slide",
              prompt=_intro(spec) + f"Add a slide titled '{title}' to the deck {path} with a "
              f"bullet giving {e['name']}'s {year} {metric}{_unit(spec, metric)}.",
              rubric=[dict(type="slide_added", path=path, title=title, contains=[_num(val)],
                           description=f"New slide '{title}' gives {val}"),
                      dict(type="slide_added", path=path, title=title, contains=[],
                           description="The slide has the requested title")],
              oracle=dict(steps=steps, answer="Slide added."))


def f_code_file(spec, rng):
  e = rng.choice(_ents(spec))
  metric = rng.choice(list(e["series"]))
  vals = [e["series"][metric][y] for y in Y]
  avg = round(sum(vals) / len(vals), 2)
  out = f"outputs/{e['slug']}_{spec_lib.slugify(metric)}_average.txt"
  src = render.entity_paths(spec, e)["xlsx"]
  code = ("import openpyxl\n"
          f"ws = openpyxl.load_workbook({src!r}, data_only=True)[{_v(spec)['sheet']!r}]\n"
          f"row = [r for r in ws.iter_rows(values_only=True) if r and r[0] == {metric!r}][0]\n"
          "avg = round(sum(row[1:5]) / 4, 2)\n"
          f"open({out!r}, 'w').write(f'{{avg:.2f}}\\n')\n"
          "print(avg)\n")
  steps = [_find(spec, e, "xlsx"),
           dict(name="code_execution_run_python", args={"code": code},
                expect=[{"text": "status: ok"}, {"number": avg}])]
  return dict(level=3, family="code_file",
              prompt=_intro(spec) + f"Using code execution, compute the average yearly {metric} of "
              f"{e['name']} over {Y[0]}-{Y[-1]} and save just that number (two decimals) to /{out}.",
              rubric=[dict(type="file_contains", path=out, contains=[{"number": avg, "decimals": 2}],
                           description=f"/{out} holds {avg}"),
                      dict(type="unchanged", path=src, description="Source workbook unchanged")],
              oracle=dict(steps=steps, answer=f"Saved {avg} to /{out}."))


FAMILIES = {
    1: (f_xlsx_lookup, f_pdf_lookup, f_docx_lookup, f_pptx_lookup, f_mail_lookup, f_chat_lookup,
        f_calendar_lookup),
    2: (f_growth, f_sum, f_max, f_cross),
    3: (f_email_figure, f_write_cell, f_book_meeting, f_post_chat, f_add_slide, f_code_file),
}


def generate(spec: dict, n: int, level_weights, rng: random.Random) -> list:
  """n distinct task candidates (distinct prompts) for one world, levels by weight,
  families of a level in round robin."""
  counts = [int(round(w / sum(level_weights) * n)) for w in level_weights]
  counts[0] += n - sum(counts)
  out, prompts = [], set()
  for level, k in zip((1, 2, 3), counts):
    fams = FAMILIES[level]
    made, tries, i = 0, 0, 0
    while made < k:
      tries += 1
      if tries > 200 * max(k, 1):
        raise RuntimeError(f"world {spec['world_id']}: cannot make {k} distinct level-{level} tasks")
      cand = fams[i % len(fams)](spec, rng)
      i += 1
      if cand["prompt"] in prompts:
        continue
      prompts.add(cand["prompt"])
      cand.setdefault("input_files", {})
      out.append(cand)
      made += 1
  return out
