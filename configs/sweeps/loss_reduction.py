"""The loss-reduction ablation: token_mean vs prompt_mean, each with the context nudge on and off.

  python launch.py --config=configs/tiny_cpu.py --mode=rl --sweep=configs/sweeps/loss_reduction.py
  python launch.py ... --sweep=configs/sweeps/loss_reduction.py --dry_run   # print the jobs

`get_sweep()` returns one dict of config overrides per job (dotted keys, as on the command
line); `name` is appended to the run name. Every arm starts from the same seed and SFT
checkpoint directory layout, so the arms differ only in these keys (add
--config.sft.dir=$PWD/runs/tiny_cpu/sft to share make run's SFT params). Results and the
command that produced them: docs/results.md, "Loss-reduction sweep".
"""
import itertools


def get_sweep(arg=None):
  del arg
  jobs = []
  for reduction, nudge in itertools.product(("token_mean", "prompt_mean"), (False, True)):
    jobs.append({"name": f"{reduction}-nudge_{'on' if nudge else 'off'}",
                 "rl.loss_reduction": reduction, "harness.nudge": nudge})
  return jobs
