"""The agent harness: one agent loop per process, token-in/token-out, every error named.

  pool = AgentPool.from_config(c, policy_factory)   # c.harness.num_workers processes
  results = pool.run(episodes)                       # one EpisodeResult per Episode, in order
  batch = collate(results, c.harness.max_timeouts_per_group, pad_to=c.train.seq_len)
  metrics = batch_metrics(results)
"""
from envs.harness.collate import batch_metrics
from envs.harness.collate import collate
from envs.harness.collate import group_train_mask
from envs.harness.agent_loop import LoopSettings
from envs.harness.agent_loop import run_episode
from envs.harness.policy import Action
from envs.harness.policy import Policy
from envs.harness.policy import SamplingParams
from envs.harness.policy import ScriptedPolicy
from envs.harness.pool import AgentPool
from envs.harness.pool import FormatSpec
from envs.harness.trajectory import Trajectory
from envs.harness.world import Episode
from envs.harness.world import EpisodeResult

__all__ = [
  "batch_metrics",
  "collate",
  "group_train_mask",
  "LoopSettings",
  "run_episode",
  "Action",
  "Policy",
  "SamplingParams",
  "ScriptedPolicy",
  "AgentPool",
  "FormatSpec",
  "Trajectory",
  "Episode",
  "EpisodeResult",
]
