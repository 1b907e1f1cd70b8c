"""World specifications: every fact of a world, derived deterministically from a seed.

A spec is plain JSON-able data (no files). `render.py` writes it to disk as real documents and
app data; `envs.tasks` derives tasks (and their answers) from the same spec, so the answers never
have to be read back from the files. The spec itself is kept outside the world directory: an
agent can only reach the facts through the apps.

Structure (all money in the unit named by the domain vocabulary):
  {world_id, domain, seed, project, client, user, people[], entities[], channels[], ...}
  entity = {name, slug, owner, series{metric: {year: value}}, profile{attr: value},
            terms{attr: value}, slide{attr: value}, mail_fact{...}, chat_fact{...}}
"""
import datetime
import hashlib
import random

DOMAINS = ("investment_banking", "management_consulting", "corporate_law")
YEARS = ("FY2021", "FY2022", "FY2023", "FY2024")

# Per-domain vocabulary. `series` metrics live in XLSX, `profile` in PDF, `terms` in DOCX,
# `slide` in one PPTX deck; `mail_fact` arrives by e-mail, `chat_fact` in a chat channel.
# Numeric attributes carry (low, high, decimals); text attributes draw from a pool.
VOCAB = {
    "investment_banking": dict(
        label="investment banking", entity_kind="company", unit="$m", team="deal team",
        projects=("Falcon", "Granite", "Harbor", "Juniper", "Keystone", "Lantern", "Meridian",
                  "Northstar", "Orchid", "Pinnacle", "Quarry", "Redwood", "Sapphire", "Tundra"),
        name_a=("Apex", "Bluewater", "Cedar", "Delta", "Ember", "Fulcrum", "Gale", "Helix", "Ion",
                "Jade", "Kestrel", "Lumen", "Magnet", "Nimbus", "Onyx", "Polar", "Quill", "Ridge",
                "Summit", "Tidal", "Umber", "Vertex", "Willow", "Zenith"),
        name_b=("Holdings", "Industries", "Logistics", "Therapeutics", "Software", "Foods",
                "Energy", "Materials", "Robotics", "Networks", "Retail", "Aerospace"),
        series={"Revenue": (200, 4000, 1), "EBITDA": (20, 800, 1), "Net income": (5, 400, 1),
                "Capex": (5, 300, 1)},
        xlsx_name="financial_model", xlsx_dir="models", sheet="Financials",
        profile={"headquarters": ("Boston", "Denver", "Austin", "Chicago", "Seattle", "Atlanta",
                                  "Toronto", "London", "Dublin", "Singapore", "Zurich", "Oslo"),
                 "chief executive": None, "employees": (300, 25000, 0),
                 "year founded": (1950, 2015, 0)},
        pdf_name="annual_report_FY2024", pdf_dir="reports", pdf_title="Annual report FY2024",
        terms={"net debt ($m)": (10, 2000, 1), "diluted shares (m)": (20, 600, 1),
               "key diligence risk": ("customer concentration", "supply chain exposure",
                                      "pending litigation", "pension deficit", "FX exposure",
                                      "key-person dependency", "regulatory review")},
        docx_name="diligence_memo", docx_dir="memos", docx_title="Diligence memo",
        slide={"valuation low ($m)": (300, 6000, 0), "valuation high ($m)": None},
        deck="pitch_book", deck_dir="decks",
        mail_fact=("share price ($)", 5, 300, 2, "Closing share price for {e}",
                   "{e} closed today at ${v} per share."),
        chat_fact=("bid deadline", "#deal-team", "Final bids for {e} are due on {v}."),
        roles=("Managing Director", "Vice President", "Associate", "Analyst", "Partner",
               "Director"),
    ),
    "management_consulting": dict(
        label="management consulting", entity_kind="business unit", unit="$m", team="case team",
        projects=("Atlas", "Beacon", "Compass", "Drift", "Echo", "Frontier", "Gemini", "Horizon",
                  "Insight", "Journey", "Kinetic", "Lighthouse", "Momentum", "Nova"),
        name_a=("North America", "Nordics", "Iberia", "Benelux", "Japan", "Brazil", "India",
                "Australia", "Mexico", "Poland", "Korea", "Canada", "Turkey", "Egypt", "Chile",
                "Vietnam", "Italy", "France", "Germany", "Gulf", "Kenya", "Peru", "Ireland",
                "Austria"),
        name_b=("Retail", "Wholesale", "Services", "Digital", "Logistics", "Consumer",
                "Industrial", "Healthcare"),
        series={"Revenue": (50, 1500, 1), "Operating cost": (40, 1200, 1),
                "Headcount": (100, 9000, 0), "Customers (k)": (5, 900, 1)},
        xlsx_name="performance", xlsx_dir="data", sheet="KPIs",
        profile={"market size ($m)": (500, 30000, 0), "market growth (%)": (1, 15, 1),
                 "lead competitor": ("Orbis", "Vantage", "Crestline", "Mosaic", "Parallax",
                                     "Tandem", "Halcyon", "Aurora", "Keel", "Stratus"),
                 "competitor share (%)": (5, 45, 1)},
        pdf_name="market_report", pdf_dir="research", pdf_title="Market report",
        terms={"unit head": None, "savings target ($m)": (1, 120, 1),
               "top pain point": ("manual order entry", "high churn", "slow onboarding",
                                  "pricing leakage", "stockouts", "long sales cycle",
                                  "legacy IT")},
        docx_name="interview_notes", docx_dir="interviews", docx_title="Interview notes",
        slide={"initiative": ("zero-based budgeting", "pricing excellence", "procurement wave",
                              "digital self-service", "network redesign", "lean operations",
                              "salesforce effectiveness"),
               "expected savings ($m)": (1, 90, 1)},
        deck="steerco_update", deck_dir="decks",
        mail_fact=("approved budget ($k)", 50, 2500, 0, "Budget approval for {e}",
                   "The steering committee approved a budget of ${v}k for {e}."),
        chat_fact=("workshop date", "#case-team", "The {e} workshop is confirmed for {v}."),
        roles=("Partner", "Principal", "Engagement Manager", "Consultant", "Analyst",
               "Expert"),
    ),
    "corporate_law": dict(
        label="corporate law", entity_kind="counterparty", unit="$k", team="matter team",
        projects=("Aurora", "Bastion", "Citadel", "Dominion", "Equinox", "Fortress", "Guardian",
                  "Heritage", "Imperial", "Justice", "Kingsway", "Legacy", "Monarch", "Noble"),
        name_a=("Abbott", "Barrow", "Calloway", "Dunmore", "Ellison", "Fairfax", "Galloway",
                "Hartwell", "Iverson", "Jessup", "Kimball", "Langford", "Merritt", "Norwood",
                "Oakley", "Prescott", "Quimby", "Rutledge", "Sterling", "Thackeray", "Underhill",
                "Vance", "Whitmore", "Yardley"),
        name_b=("LLC", "Ltd", "Partners", "Group", "Capital", "Trust", "Ventures", "plc"),
        series={"Fees billed": (20, 900, 1), "Hours": (40, 2400, 0), "Expenses": (1, 90, 1),
                "Contract value": (100, 9000, 1)},
        xlsx_name="billing", xlsx_dir="billing", sheet="Matter",
        profile={"case number": None, "court": ("Delaware Chancery", "S.D.N.Y.", "N.D. Cal.",
                                                 "High Court London", "D. Mass.", "N.D. Ill."),
                 "damages claimed ($m)": (1, 250, 1), "filing date": None},
        pdf_name="complaint", pdf_dir="filings", pdf_title="Complaint summary",
        terms={"governing law": ("Delaware", "New York", "California", "England and Wales",
                                 "Texas", "Ontario"),
               "term (years)": (1, 10, 0), "liability cap ($k)": (100, 20000, 0),
               "notice period (days)": (10, 120, 0)},
        docx_name="master_agreement", docx_dir="contracts", docx_title="Master services agreement",
        slide={"risk rating": ("low", "medium", "high", "critical"),
               "exposure ($k)": (50, 15000, 0)},
        deck="board_briefing", deck_dir="decks",
        mail_fact=("settlement offer ($k)", 50, 9000, 0, "Settlement proposal - {e}",
                   "On behalf of our client we propose to settle the {e} matter for ${v}k."),
        chat_fact=("response deadline", "#matter-team", "Our response to {e} is due {v}."),
        roles=("Partner", "Counsel", "Senior Associate", "Associate", "Paralegal",
               "General Counsel"),
    ),
}

FIRST = ("Ava", "Ben", "Chloe", "Daniel", "Elena", "Farah", "Gabriel", "Hana", "Isaac", "Julia",
         "Kenji", "Laura", "Mateo", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Samuel",
         "Tara", "Umar", "Vera", "Wei", "Yusuf", "Zoe", "Aaron", "Bianca", "Carlos", "Dana",
         "Emil")
LAST = ("Abara", "Bennett", "Castillo", "Dubois", "Eriksen", "Fischer", "Garcia", "Haddad",
        "Ito", "Jensen", "Kowalski", "Larsen", "Moreau", "Nakamura", "Okafor", "Patel",
        "Quinn", "Rossi", "Schmidt", "Tanaka", "Ueda", "Varga", "Walsh", "Xu", "Yilmaz",
        "Zhang")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")


def world_seed(base_seed: int, domain: str, index: int) -> int:
  """A stable 63-bit seed per (base seed, domain, index); independent of Python's hash salt."""
  h = hashlib.sha256(f"{base_seed}/{domain}/{index}".encode()).digest()
  return int.from_bytes(h[:8], "little") >> 1


def world_id(domain: str, index: int) -> str:
  return f"{domain[:2]}{index:02d}"  # "in03", "ma00", "co10"


def _num(rng: random.Random, lo: float, hi: float, dec: int) -> float:
  v = round(rng.uniform(lo, hi), dec)
  return int(v) if dec == 0 else v


def _date(rng: random.Random, year: int = 2025) -> str:
  """ISO date on a weekday in `year` (months 2-11 keep all dates inside one calendar year)."""
  while True:
    d = datetime.date(year, rng.randint(2, 11), rng.randint(1, 28))
    if d.weekday() < 5:
      return d.isoformat()


def _person(rng, used):
  while True:
    n = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    if n not in used:
      used.add(n)
      return n


def slugify(s: str) -> str:
  out = "".join(ch.lower() if ch.isalnum() else "_" for ch in s)
  while "__" in out:
    out = out.replace("__", "_")
  return out.strip("_")


def build_spec(domain: str, index: int, base_seed: int, num_entities: int,
               num_distractor_entities: int, num_people: int) -> dict:
  """All facts of world (domain, index). Cheap (pure Python, no files).

  Args:
    num_entities: entities tasks may ask about (each gets one file of every type).
    num_distractor_entities: extra entities with the same kinds of files, never asked about.
    num_people: colleagues with e-mail addresses and chat handles.
  """
  v = VOCAB[domain]
  seed = world_seed(base_seed, domain, index)
  rng = random.Random(seed)
  wid = world_id(domain, index)
  # Project names are unique per (domain, index) so prompts never repeat across worlds.
  project = f"{v['projects'][index % len(v['projects'])]}"
  if index >= len(v["projects"]):
    project += f" {index // len(v['projects']) + 1}"
  used_names: set = set()
  people = []
  for i in range(num_people):
    name = _person(rng, used_names)
    first, last = name.split(" ")
    people.append(dict(name=name, role=v["roles"][i % len(v["roles"])],
                       email=f"{first.lower()}.{last.lower()}@{slugify(project)}.example.com",
                       handle=f"@{first.lower()}{last[0].lower()}"))
  user = people[0]  # the mailbox / calendar owner; the agent acts as this person
  ent_names: set = set()
  entities = []
  for i in range(num_entities + num_distractor_entities):
    while True:
      name = f"{rng.choice(v['name_a'])} {rng.choice(v['name_b'])}"
      if name not in ent_names:
        ent_names.add(name)
        break
    e = dict(name=name, slug=slugify(name), distractor=i >= num_entities,
             owner=people[1 + i % (num_people - 1)]["name"])
    series = {}
    for metric, (lo, hi, dec) in v["series"].items():
      base = rng.uniform(lo, hi)
      vals = {}
      for y in YEARS:
        base *= rng.uniform(0.85, 1.25)
        vals[y] = int(round(base)) if dec == 0 else round(base, dec)
      series[metric] = vals
    _derive(domain, rng, series)
    e["series"] = series
    e["profile"] = _attrs(rng, v["profile"], used_names)
    e["terms"] = _attrs(rng, v["terms"], used_names)
    e["slide"] = _attrs(rng, v["slide"], used_names)
    if "valuation high ($m)" in e["slide"]:
      e["slide"]["valuation high ($m)"] = int(e["slide"]["valuation low ($m)"] *
                                              rng.uniform(1.1, 1.6))
    label, lo, hi, dec, subj, body = v["mail_fact"]
    val = _num(rng, lo, hi, dec)
    sender = people[1 + rng.randrange(num_people - 1)]
    e["mail_fact"] = dict(label=label, value=val, sender=sender["name"],
                          subject=subj.format(e=name), body=body.format(e=name, v=val),
                          date=_date(rng))
    clabel, channel, text = v["chat_fact"]
    d = _date(rng)
    e["chat_fact"] = dict(label=clabel, value=d, channel=channel,
                          author=people[1 + rng.randrange(num_people - 1)]["name"],
                          text=text.format(e=name, v=d))
    entities.append(e)
  # Calendar: one review meeting per entity plus a weekly internal sync.
  events = []
  for i, e in enumerate(entities):
    events.append(dict(id=f"evt{i:03d}", title=f"{e['name']} review", date=_date(rng),
                       start=f"{rng.randint(9, 16):02d}:{rng.choice(('00', '30'))}",
                       duration_min=rng.choice((30, 45, 60)),
                       attendees=sorted({user["email"], _email(people, e["owner"])})))
  events.append(dict(id="evt_sync", title=f"Project {project} weekly sync", date=_date(rng),
                     start="09:00", duration_min=30,
                     attendees=sorted(p["email"] for p in people)))
  return dict(world_id=wid, domain=domain, index=index, seed=seed, project=project,
              user=user, people=people, entities=entities, events=events,
              channels=sorted({v["chat_fact"][1], "#general", "#random"}))


def _derive(domain, rng, series):
  """Makes metrics of one entity consistent with each other (margins, cost ratios)."""
  if domain == "investment_banking":
    m, conv, cx = rng.uniform(0.08, 0.3), rng.uniform(0.3, 0.6), rng.uniform(0.02, 0.08)
    for y, rev in series["Revenue"].items():
      series["EBITDA"][y] = round(rev * m * rng.uniform(0.9, 1.1), 1)
      series["Net income"][y] = round(series["EBITDA"][y] * conv * rng.uniform(0.9, 1.1), 1)
      series["Capex"][y] = round(rev * cx * rng.uniform(0.9, 1.1), 1)
  elif domain == "management_consulting":
    r = rng.uniform(0.7, 0.95)
    for y, rev in series["Revenue"].items():
      series["Operating cost"][y] = round(rev * r * rng.uniform(0.95, 1.05), 1)


def _email(people, name):
  return next(p["email"] for p in people if p["name"] == name)


def _attrs(rng, table, used_names):
  out = {}
  for attr, spec in table.items():
    if spec is None:
      if attr in ("chief executive", "unit head"):
        out[attr] = _person(rng, used_names)
      elif attr == "case number":
        out[attr] = f"{rng.randint(20, 25)}-cv-{rng.randint(1000, 9999)}"
      elif attr == "filing date":
        out[attr] = _date(rng, 2024)
      else:
        out[attr] = None  # filled by the caller
    elif isinstance(spec[0], str):
      out[attr] = rng.choice(spec)
    else:
      out[attr] = _num(rng, *spec)
  return out


def fmt_value(v, attr: str = "") -> str:
  """How a number is written in documents: thousands separators (not in years), decimals kept."""
  if isinstance(v, int) and "year" in attr and "years" not in attr:
    return str(v)
  if isinstance(v, int):
    return f"{v:,}"
  if isinstance(v, float):
    return f"{v:,.2f}".rstrip("0").rstrip(".") if abs(v - round(v, 1)) > 1e-9 else f"{v:,.1f}"
  return str(v)
