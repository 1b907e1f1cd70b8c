"""A stand-in world process for the harness tests (standard library only).

One JSON request per line on stdin, one JSON reply per line on stdout:
  {"method": "tools"}                                  -> {"tools": [...]}
  {"method": "call", "name": N, "arguments": {...}}    -> {"text": ..., "is_error": bool}
Its tools include the faults the harness must survive: `hang` never returns in time, `crash`
raises inside the tool, `die` kills this process mid-episode.
"""
import json
import os
import signal
import sys
import time
import traceback

TOOLS = [
    ("lookup", "Look up the value stored under a key.", {"key": "string"}, ["key"]),
    ("echo", "Return the text, repeated `times` times.", {"text": "string", "times": "integer"},
     ["text"]),
    ("hang", "Sleep for a number of seconds.", {"seconds": "number"}, ["seconds"]),
    ("crash", "Raise an exception inside the tool.", {}, []),
    ("die", "Kill the world process.", {}, []),
]


def _schemas():
  return [{"type": "function", "function": {
      "name": n, "description": d,
      "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in p.items()},
                     "required": r}}} for n, d, p, r in TOOLS]


def main():
  facts = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
  out = sys.stdout
  for line in sys.stdin:
    req = json.loads(line)
    if req["method"] == "tools":
      reply = {"tools": _schemas()}
    else:
      name, args = req["name"], req.get("arguments") or {}
      try:
        if name == "lookup":
          if args["key"] not in facts:
            raise KeyError(f"no value stored under {args['key']!r}")
          text = facts[args["key"]]
        elif name == "echo":
          text = str(args["text"]) * int(args.get("times", 1))
        elif name == "hang":
          time.sleep(float(args["seconds"]))
          text = "slept"
        elif name == "crash":
          text = str(1 / 0)
        elif name == "die":
          os.kill(os.getpid(), signal.SIGKILL)
          text = "unreachable"
        else:
          raise ValueError(f"unknown tool {name}")
        reply = {"text": text, "is_error": False}
      except Exception as e:  # noqa: BLE001 - a tool error goes back to the caller
        reply = {"text": f"Error: {type(e).__name__}: {e}\n{traceback.format_exc(limit=2)}",
                 "is_error": True}
    out.write(json.dumps(reply) + "\n")
    out.flush()


if __name__ == "__main__":
  main()
