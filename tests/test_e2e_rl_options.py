"""Every option of the RL config runs end to end: `launch.py --mode=rl` for two steps from the
shipped base (real JetStream server, worlds, agent pool, orbax checkpoints) under each arm below,
and between them the arms cover every registered advantage estimator, policy loss and loss
reduction, both TIS modes, both KL estimators (the KL penalty's reference policy held in the
train state), dynamic sampling, bounded staleness, recomputed old logprobs, mini-batches, the
dual clip, the MoE balance loss, SGD and LoRA (adapters on a frozen base, the KL reference the
base, the weight sync the adapters alone). The default (GRPO, DPPO binary-TV, prompt_mean) is
the arm of tests/test_e2e_pod.py (which also checks that its loss acts on non-zero advantages)
and tests/test_e2e_rl.py, and counts here as one.

Slow (one launch per arm, 1-5 minutes each on 2 cores, longer beside other tests): `make test-all`.
"""
import json
import os
import subprocess
import sys

import pytest

from configs import tiny_cpu
from models import qwen3_5
from rl import advantages
from rl import reductions
from rl import policy_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# No engine warmup: an arm compiles only the programs its rollouts run (the rloo arm
# 195 -> 148 s alone on 2 cores, cold compile cache, at 9643292);
# tests/rl/rollout/test_warmup.py and tests/test_e2e_rl.py run warmup.
# Two steps of 2 prompts x 4 samples at temperature 1.0: the base passes ~1 in 8 level-1 tasks,
# and these draws hold informative groups, so the losses see non-zero advantages.
COMMON = {"sft.steps": 0, "loop.eval_max_tasks": 2, "train.steps": 2,
          "train.prompts_per_step": 2, "train.samples_per_prompt": 4, "train.micro_batches": 2,
          "checkpoint.save_every": 1, "checkpoint.async_save": False,
          "harness.num_workers": 4, "loop.progress": False, "loop.bootstrap": 100,
          "rollout.warmup": False}

ARMS = {
    "rloo_ppo_token_kl_k1": {
        "rl.advantage": "rloo", "rl.policy_loss": "ppo", "rl.ppo.dual_clip_c": 3.0,
        "rl.loss_reduction": "token_mean", "rl.tis.mode": "token", "rl.kl.coef": 0.1,
        "rl.kl.estimator": "k1", "rl.recompute_old_logprobs": True, "train.mini_batches": 2,
        "train.micro_batches": 1},
    # LoRA: adapters on a frozen base, the KL reference the base with the adapters off, the
    # weight sync the adapters alone. Dynamic sampling (max_draws): the first step's draws hold
    # no informative group without it, so nothing would update and the KL check below would
    # have nothing to see.
    "grpo_std_gspo_sequence_lora_kl_k3_dynamic_stale": {
        "rl.advantage": "grpo", "rl.grpo_norm_by_std": True, "rl.policy_loss": "gspo",
        "rl.loss_reduction": "sequence_mean", "rl.tis.mode": "sequence", "rl.kl.coef": 0.1,
        "rl.kl.estimator": "k3", "train.max_draws": 3, "loop.max_staleness": 1,
        "lora.rank": 4, "optim.trainable": "", "optim.lr": 1e-3},
    "rollout_is_dr_grpo_unfiltered_moe_sgd": {
        "rl.policy_loss": "rollout_is", "rl.loss_reduction": "seq_mean_token_sum_norm",
        "rl.filter_zero_variance": False, "rl.moe_aux_loss_coef": 0.01, "optim.name": "sgd",
        "optim.lr": 0.05},
}
# The default configuration's arm, run by tests/test_e2e_pod.py.
_DEFAULT = tiny_cpu.get_config()
DEFAULT_ARM = {"rl.advantage": _DEFAULT.rl.advantage, "rl.policy_loss": _DEFAULT.rl.policy_loss,
               "rl.loss_reduction": _DEFAULT.rl.loss_reduction,
               "rl.tis.mode": _DEFAULT.rl.tis.mode}


def _run(tmp_path, name, arm, env) -> list:
  cmd = [sys.executable, os.path.join(ROOT, "launch.py"), "--mode=rl",
         "--config=" + os.path.join(ROOT, "configs/tiny_cpu.py"), f"--config.workdir={tmp_path}",
         f"--config.name={name}", f"--config.envs.worlds_root={os.path.join(ROOT, 'runs/worlds')}"]
  cmd += [f"--config.{k}={v}" for k, v in {**COMMON, **arm}.items()]
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  with open(os.path.join(tmp_path, name, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return sorted((r for r in rows if r["phase"] == "train"), key=lambda r: r["step"])


def test_the_arms_cover_every_registered_option():
  arms = [*ARMS.values(), DEFAULT_ARM]
  values = lambda key, default: {arm.get(key, default) for arm in arms}
  assert values("rl.advantage", "grpo") == set(advantages.available_advantage_estimators())
  assert values("rl.policy_loss", "dppo_binary_tv") == set(policy_losses.available_policy_losses())
  assert values("rl.loss_reduction", "prompt_mean") == set(reductions.available_loss_reductions())
  assert values("rl.tis.mode", "none") == {"none", "token", "sequence"}
  assert values("rl.kl.estimator", None) - {None} == {"k1", "k3"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ARMS))
def test_rl_option_runs_end_to_end(tmp_path, name, launched_job_env):
  arm = ARMS[name]
  train = _run(tmp_path, name, arm, launched_job_env)
  assert [r["step"] for r in train] == [1, 2]
  for r in train:
    assert all(v == v for v in r.values() if isinstance(v, float)), r   # no NaN
  # The batches held signal, so the configured loss acted on non-zero advantages.
  assert sum(r["train/live_rows"] for r in train) > 0
  assert any(r["optim/update_norm"] > 0 for r in train)
  if arm.get("rl.tis.mode", "none") != "none":
    assert all("policy/tis_weight" in r for r in train)
  if arm.get("rl.kl.coef"):
    # The first update's policy is the reference (KL 0: with one mini-batch, step 1 is that
    # update alone); the second step's has moved from it, and the penalty is in the loss.
    if arm.get("train.mini_batches", 1) == 1:
      assert abs(train[0]["policy/kl_ref"]) < 1e-6
      # One update a step: step 2's KL is step 1's update, so step 1 must have made one (else
      # the KL below is float rounding at best).
      assert train[0]["optim/update_norm"] > 0, "step 1 updated nothing: no KL to see at step 2"
    assert abs(train[1]["policy/kl_ref"]) > 0
    if arm.get("rl.loss_reduction") == "token_mean":   # loss and metrics weigh tokens alike
      for r in train:
        assert r["loss/total"] == pytest.approx(
            r["policy/pg_loss"] + arm["rl.kl.coef"] * r["policy/kl_ref"], rel=1e-4, abs=1e-7)
  if arm.get("train.max_draws", 1) > 1:
    assert all(r["train/draws"] >= 1 for r in train)
    assert all("train/informative_groups_drawn" in r for r in train)
  if arm.get("loop.max_staleness"):
    assert [r["rollout/staleness"] for r in train] == [0.0, 1.0]
  if arm.get("rl.moe_aux_loss_coef"):
    assert all(r["loss/moe_load_balance"] > 0 for r in train)
  if arm.get("lora.rank"):
    # Each sync sends the adapters alone: rank-4 pairs, a fraction of the model's bytes.
    model_bytes = 4 * qwen3_5.count_params(qwen3_5.config_from_dict(_DEFAULT.model))["total"]
    assert {r["sync/bytes"] for r in train} == {train[0]["sync/bytes"]}
    assert 0 < train[0]["sync/bytes"] < model_bytes / 3
