"""Writes a world spec to disk as real documents and app data, byte-for-byte reproducibly.

Layout of a world directory:
  files/   what the agent's filesystem and document apps see (and the code sandbox's cwd)
    <xlsx_dir>/<entity>_<name>.xlsx   one workbook per entity (sheet of metric x year)
    <pdf_dir>/<entity>_<name>.pdf     one report per entity (profile facts)
    <docx_dir>/<entity>_<name>.docx   one memo / contract per entity (terms)
    <deck_dir>/project_<p>_<deck>.pptx one deck, one slide per entity
    summary/summary_workbook.xlsx     the workbook tasks write results into
    archive/, notes/                  distractors: superseded drafts, meeting notes, exports
    inputs/, outputs/                 task input files are placed in inputs/ per episode
  apps/    mail.json, chat.json, calendar.json (reached only through the app tools)

Reproducibility: reportlab runs with invariant=1; Office files get fixed core properties and
are re-zipped with fixed timestamps, so the same seed gives identical bytes.
"""
import csv
import datetime
import io
import json
import os
import random
import re
import zipfile

from envs.worlds import spec as spec_lib

_FIXED_DT = datetime.datetime(2025, 1, 1, 0, 0, 0)
_ZIP_DT = (2025, 1, 1, 0, 0, 0)


def entity_paths(spec: dict, entity: dict) -> dict:
  """Paths (relative to files/) of an entity's documents, by kind."""
  v = spec_lib.VOCAB[spec["domain"]]
  s = entity["slug"]
  return dict(xlsx=f"{v['xlsx_dir']}/{s}_{v['xlsx_name']}.xlsx",
              pdf=f"{v['pdf_dir']}/{s}_{v['pdf_name']}.pdf",
              docx=f"{v['docx_dir']}/{s}_{v['docx_name']}.docx")


def deck_path(spec: dict) -> str:
  v = spec_lib.VOCAB[spec["domain"]]
  return f"{v['deck_dir']}/project_{spec_lib.slugify(spec['project'])}_{v['deck']}.pptx"


SUMMARY_PATH = "summary/summary_workbook.xlsx"
SUMMARY_SHEET = "Summary"


def _normalize_zip(path: str):
  """Rewrites an OOXML zip with fixed timestamps and a stable entry order."""
  with zipfile.ZipFile(path) as z:
    entries = [(i.filename, z.read(i.filename)) for i in z.infolist()]
  # Writers stamp "modified" with the wall clock on save; pin it.
  entries = [(n, re.sub(rb"(<dcterms:modified[^>]*>)[^<]*(</dcterms:modified>)",
                        rb"\g<1>2025-01-01T00:00:00Z\g<2>", d) if n == "docProps/core.xml" else d)
             for n, d in entries]
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
    for name, data in entries:
      info = zipfile.ZipInfo(name, date_time=_ZIP_DT)
      info.compress_type = zipfile.ZIP_DEFLATED
      info.external_attr = 0o644 << 16
      z.writestr(info, data)
  with open(path, "wb") as f:
    f.write(buf.getvalue())


def _filler(rng: random.Random, spec: dict, entity: dict, n: int) -> list:
  v = spec_lib.VOCAB[spec["domain"]]
  pool = (
      f"This document was prepared for the {v['team']} of Project {spec['project']}.",
      f"{entity['name']} remains a focus {v['entity_kind']} for the engagement.",
      "Figures are unaudited unless stated otherwise and may be revised.",
      "Management commentary was collected in interviews during the review period.",
      "Comparisons are on a like-for-like basis, excluding one-off items.",
      f"Questions should be directed to {entity['owner']}.",
      "Sources include company filings, management accounts and team estimates.",
      "Distribution is restricted to the engagement team and its advisers.",
  )
  return [rng.choice(pool) for _ in range(n)]


def write_pdf(path: str, title: str, lines: list):
  """A text PDF (reportlab). One fact per line so that extracted text keeps it whole."""
  from reportlab.lib.pagesizes import A4  # lazy: document library, only when worlds render
  from reportlab.pdfgen import canvas  # lazy: document library, only when worlds render
  c = canvas.Canvas(path, pagesize=A4, invariant=1)
  c.setTitle(title)
  c.setAuthor("world generator")
  width, height = A4
  y = height - 60
  c.setFont("Helvetica-Bold", 15)
  c.drawString(50, y, title)
  y -= 28
  c.setFont("Helvetica", 10)
  for line in lines:
    if y < 60:
      c.showPage()
      c.setFont("Helvetica", 10)
      y = height - 60
    c.drawString(50, y, line)
    y -= 15
  c.save()


def write_xlsx(path: str, sheets: dict):
  """sheets: {name: rows (list of lists)}; values stored, never formulas."""
  import openpyxl  # lazy: document library, only when worlds render
  wb = openpyxl.Workbook()
  wb.remove(wb.active)
  for name, rows in sheets.items():
    ws = wb.create_sheet(name)
    for r in rows:
      ws.append(list(r))
  wb.properties.creator = "world generator"
  wb.properties.created = _FIXED_DT
  wb.properties.modified = _FIXED_DT
  wb.save(path)
  _normalize_zip(path)


def write_docx(path: str, title: str, paragraphs: list, table: list = None):
  import docx  # lazy: document library, only when worlds render
  d = docx.Document()
  d.add_heading(title, level=1)
  for p in paragraphs:
    d.add_paragraph(p)
  if table:
    t = d.add_table(rows=len(table), cols=len(table[0]))
    for i, row in enumerate(table):
      for j, val in enumerate(row):
        t.cell(i, j).text = str(val)
  cp = d.core_properties
  cp.author = "world generator"
  cp.created = _FIXED_DT
  cp.modified = _FIXED_DT
  cp.last_printed = _FIXED_DT
  cp.revision = 1
  d.save(path)
  _normalize_zip(path)


def write_pptx(path: str, title: str, slides: list):
  """slides: list of (title, [bullet lines])."""
  from pptx import Presentation  # lazy: document library, only when worlds render
  prs = Presentation()
  s = prs.slides.add_slide(prs.slide_layouts[0])
  s.shapes.title.text = title
  s.placeholders[1].text = "Confidential - prepared for internal discussion"
  for stitle, bullets in slides:
    s = prs.slides.add_slide(prs.slide_layouts[1])
    s.shapes.title.text = stitle
    body = s.placeholders[1].text_frame
    body.text = bullets[0]
    for b in bullets[1:]:
      body.add_paragraph().text = b
  cp = prs.core_properties
  cp.author = "world generator"
  cp.created = _FIXED_DT
  cp.modified = _FIXED_DT
  cp.last_printed = _FIXED_DT
  cp.revision = 1
  prs.save(path)
  _normalize_zip(path)


def _dump_json(path, obj):
  with open(path, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
    f.write("\n")


def render_world(spec: dict, out_dir: str, num_note_files: int):
  """Writes `spec` under out_dir (created; must not hold another world).

  Args:
    num_note_files: cheap distractor files (meeting notes, CSV exports) on top of the
      documents every entity gets.
  """
  v = spec_lib.VOCAB[spec["domain"]]
  rng = random.Random(spec["seed"] ^ 0x5EED)
  files = os.path.join(out_dir, "files")
  for sub in (v["xlsx_dir"], v["pdf_dir"], v["docx_dir"], v["deck_dir"], "summary", "archive",
              "notes", "inputs", "outputs"):
    os.makedirs(os.path.join(files, sub), exist_ok=True)
  os.makedirs(os.path.join(out_dir, "apps"), exist_ok=True)
  unit = v["unit"]
  fv = spec_lib.fmt_value
  for e in spec["entities"]:
    p = entity_paths(spec, e)
    # XLSX: metric x year, plus an assumptions sheet that is pure distraction.
    rows = [[f"{e['name']} - {v['xlsx_name'].replace('_', ' ')}"], [],
            ["Metric"] + list(spec_lib.YEARS)]
    for metric, vals in e["series"].items():
      rows.append([metric] + [vals[y] for y in spec_lib.YEARS])
    rows += [[], [f"Units: {unit} unless stated otherwise"]]
    assumptions = [["Assumption", "Value"], ["Inflation (%)", round(rng.uniform(1, 5), 1)],
                   ["Discount rate (%)", round(rng.uniform(6, 12), 1)],
                   ["Scenario", rng.choice(("base", "upside", "downside"))]]
    write_xlsx(os.path.join(files, p["xlsx"]), {v["sheet"]: rows, "Assumptions": assumptions})
    # PDF: profile facts, one per line, inside filler text.
    lines = [f"{v['entity_kind'].capitalize()}: {e['name']}", ""]
    lines += _filler(rng, spec, e, 3) + [""]
    lines.append("Key facts")
    for attr, val in e["profile"].items():
      lines.append(f"{attr.capitalize()}: {fv(val, attr)}")
    lines += [""] + _filler(rng, spec, e, 4)
    write_pdf(os.path.join(files, p["pdf"]), f"{e['name']} - {v['pdf_title']}", lines)
    # DOCX: terms as "Attribute: value" paragraphs and a table repeating them.
    paras = [f"{v['entity_kind'].capitalize()}: {e['name']}"] + _filler(rng, spec, e, 2)
    paras += [f"{attr.capitalize()}: {fv(val, attr)}" for attr, val in e["terms"].items()]
    paras += _filler(rng, spec, e, 2)
    write_docx(os.path.join(files, p["docx"]), f"{v['docx_title']} - {e['name']}", paras,
               table=[["Item", "Detail"]] + [[a.capitalize(), fv(x, a)] for a, x in e["terms"].items()])
  # One deck, one slide per entity.
  slides = [(e["name"], [f"{a.capitalize()}: {fv(x, a)}" for a, x in e["slide"].items()] +
             [f"Owner: {e['owner']}"]) for e in spec["entities"]]
  write_pptx(os.path.join(files, deck_path(spec)),
             f"Project {spec['project']} - {v['deck'].replace('_', ' ')}", slides)
  # The summary workbook tasks write into: one row per entity, empty result columns.
  write_xlsx(os.path.join(files, SUMMARY_PATH),
             {SUMMARY_SHEET: [[v["entity_kind"].capitalize(), "Result", "Comment"]] +
              [[e["name"], None, None] for e in spec["entities"]]})
  # Distractors: superseded drafts with different numbers, notes and CSV exports.
  for i in range(num_note_files):
    e = spec["entities"][i % len(spec["entities"])]
    kind = i % 3
    if kind == 0:
      metric = list(e["series"])[i % len(e["series"])]
      draft = {y: round(val * rng.uniform(0.7, 0.95), 1) for y, val in e["series"][metric].items()}
      with open(os.path.join(files, "archive", f"{e['slug']}_{spec_lib.slugify(metric)}_draft_v{i}.csv"),
                "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["DRAFT - superseded, do not use"])
        w.writerow(["Metric"] + list(spec_lib.YEARS))
        w.writerow([metric] + [draft[y] for y in spec_lib.YEARS])
    elif kind == 1:
      with open(os.path.join(files, "notes", f"meeting_notes_{i:03d}.md"), "w") as f:
        f.write(f"# Meeting notes {i}\n\nAttendees: {e['owner']}, {spec['user']['name']}\n\n")
        f.write("\n".join(f"- {s}" for s in _filler(rng, spec, e, 4)) + "\n")
    else:
      with open(os.path.join(files, "notes", f"todo_{i:03d}.txt"), "w") as f:
        f.write(f"Follow up with {rng.choice(spec['people'])['name']} on {e['name']}.\n")
  _write_apps(spec, out_dir, rng)


def _write_apps(spec: dict, out_dir: str, rng: random.Random):
  user = spec["user"]
  by_name = {p["name"]: p for p in spec["people"]}
  messages = []
  for i, e in enumerate(spec["entities"]):
    m = e["mail_fact"]
    messages.append(dict(id=f"m{i:03d}", folder="inbox", sender=by_name[m["sender"]]["email"],
                         to=[user["email"]], cc=[], subject=m["subject"], date=m["date"],
                         body=f"Hi {user['name'].split()[0]},\n\n{m['body']}\n\nBest,\n{m['sender']}"))
  for j in range(len(spec["entities"])):
    p = rng.choice(spec["people"][1:])
    messages.append(dict(id=f"n{j:03d}", folder="inbox", sender=p["email"], to=[user["email"]],
                         cc=[], subject=rng.choice(("Team lunch", "Expense reminder",
                                                    "Office move", "Training slots",
                                                    "Weekly newsletter")),
                         date=spec_lib._date(rng),
                         body="Hi all,\n\nA reminder about this week's logistics. No action needed.\n"))
  messages.sort(key=lambda x: (x["date"], x["id"]))
  _dump_json(os.path.join(out_dir, "apps", "mail.json"),
             dict(owner=user["email"], contacts=spec["people"], messages=messages))
  channels = {c: [] for c in spec["channels"]}
  for i, e in enumerate(spec["entities"]):
    c = e["chat_fact"]
    channels[c["channel"]].append(dict(id=f"c{i:03d}", user=by_name[c["author"]]["handle"],
                                       date=spec_lib._date(rng), text=c["text"]))
    channels["#random"].append(dict(id=f"r{i:03d}", user=rng.choice(spec["people"])["handle"],
                                    date=spec_lib._date(rng), text=rng.choice(
                                        ("Coffee anyone?", "Printer on 3 is fixed.",
                                         "Great work on the last deliverable!",
                                         "Reminder: timesheets due Friday."))))
  for msgs in channels.values():
    msgs.sort(key=lambda x: (x["date"], x["id"]))
  _dump_json(os.path.join(out_dir, "apps", "chat.json"),
             dict(members=[dict(name=p["name"], handle=p["handle"]) for p in spec["people"]],
                  channels=channels))
  _dump_json(os.path.join(out_dir, "apps", "calendar.json"),
             dict(owner=user["email"], events=sorted(spec["events"], key=lambda x: x["id"])))
