"""One job on 1 process vs 2 processes of this machine, side by side, and what a weight sync
moves per host for the full-size configs.

    python benchmarks/pod_scaling.py                    # 4 RL steps of 4 prompts x 4 samples
    python benchmarks/pod_scaling.py --steps=6 --set=train.prompts_per_step=8

Both arms are the same `launch.py --mode=rl` run (the tiny default from the shipped base, SFT
skipped, same tasks and seeds) through scripts/local_pod.py: 1 process x 8 CPU devices, and 2
processes x 4. The machine's cores are the same in both, so the ratio is the cost of being
distributed (exchanging episodes through the coordinator, gloo collectives, each host gathering
the weights for its own engine), not a speedup. Prints per arm the RL steps' wall time (steps
2.., the first holding the compiles), rollout episodes per second, and weight-sync time; then,
from shapes, the bytes each host gathers per weight sync for the 35B and 397B configs on their
planned hosts. Asserts nothing.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import qwen3_5_35b_a3b  # noqa: E402
from configs import qwen3_5_397b_a17b  # noqa: E402
from rl import plan  # noqa: E402


def arm(tmp: str, processes: int, steps: int, extra: list) -> dict:
  name = f"pod{processes}"
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "local_pod.py"),
         f"--processes={processes}", f"--devices_per_process={8 // processes}",
         f"--log_dir={os.path.join(tmp, name + '-logs')}", "--",
         "--mode=rl", "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"),
         f"--config.workdir={tmp}", f"--config.name={name}", "--config.sft.steps=0",
         "--config.loop.eval_max_tasks=2", "--config.loop.progress=False",
         f"--config.train.steps={steps}", "--config.train.prompts_per_step=4",
         "--config.train.samples_per_prompt=4", "--config.checkpoint.save_every=0",
         "--config.loop.tensorboard=False"] + [f"--config.{s}" for s in extra]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  if out.returncode:
    sys.exit(f"arm {name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
  with open(os.path.join(tmp, name, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  later = sorted((m for m in rows if m["phase"] == "train"), key=lambda m: m["step"])[1:]
  episodes = sum(m["episodes"] for m in later)
  rollout_s = sum(m["time/rollout_s"] for m in later)
  return {"processes": processes, "steps_s": sum(m["time/step_s"] for m in later),
          "episodes_per_s": episodes / max(rollout_s, 1e-9),
          "sync_s": sum(m["time/weight_sync_s"] for m in later), "steps": len(later),
          "loss": [round(m["loss/total"], 6) for m in later]}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--set", action="append", default=[], help="key=value config override")
  args = ap.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    one, two = arm(tmp, 1, args.steps, args.set), arm(tmp, 2, args.steps, args.set)
  print(f"\n{'':34s}{'1 x 8 devices':>16s}{'2 x 4 devices':>16s}{'2 / 1':>8s}")
  for key, label in (("steps_s", f"RL steps 2..{args.steps} wall (s)"),
                     ("episodes_per_s", "rollout episodes / s"),
                     ("sync_s", "weight sync, summed (s)")):
    a, b = one[key], two[key]
    print(f"{label:34s}{a:16.2f}{b:16.2f}{(b / a if a else float('nan')):8.2f}")
  print(f"losses (steps 2..): 1 process {one['loss']}, 2 processes {two['loss']}")
  print("\nweight sync per step, each host gathering the shards its devices do not hold "
        "(rl/distributed.host_copy), from shapes:")
  for mod, devices, hosts in ((qwen3_5_35b_a3b, 16, 2), (qwen3_5_397b_a17b, 64, 8),
                              (qwen3_5_397b_a17b, 64, 16)):
    c = mod.get_config()
    b = plan.weight_sync_bytes_per_host(c, devices, hosts)
    print(f"  {c.name:22s} {devices} devices on {hosts} hosts: {b / 2**30:8.1f} GiB per host "
          f"({c.model.param_dtype})")


if __name__ == "__main__":
  main()
