"""World seeds (config.envs.seed) split by what they may be used for: the experiment protocol.

  DEV_SEEDS        tuning, ablations, sweeps, the tiny base's SFT, `make run`, every figure that
                   chose a setting. Seed 0 is the default worlds; seed 7 was looked at once
                   (a replication attempt of an earlier default), so it counts as seen.
  REPORTING_SEEDS  held back: no setting is chosen by looking at runs on them. Only
                   `benchmarks/rl_replication.py` runs them, to report what a chosen setting
                   does on worlds nobody tuned on.

A seed's worlds (train and eval split alike) are generated from it, so the two sets share no
world, no file and no task. `launch.py --sweep` refuses a reporting seed (`check_tuning`).
"""

DEV_SEEDS = (0, 7)
REPORTING_SEEDS = (101, 102, 103)


def check_tuning(envs_seed: int) -> None:
  """Stops a tuning run (a sweep) on a reporting seed, naming the protocol."""
  if int(envs_seed) in REPORTING_SEEDS:
    raise SystemExit(
        f"envs.seed={envs_seed} is a reporting seed (configs/seeds.py: {REPORTING_SEEDS}); "
        f"sweeps and tuning run on the dev seeds {DEV_SEEDS}. Report a chosen setting on the "
        f"reporting seeds with: python benchmarks/rl_replication.py --config.<key>=<value>")


def worlds_root(seed: int) -> str:
  """Where a seed's worlds are rendered (relative to the repository): runs/worlds for the
  default seed 0, runs/worlds_s<seed> for the others."""
  return "runs/worlds" if int(seed) == 0 else f"runs/worlds_s{int(seed)}"
