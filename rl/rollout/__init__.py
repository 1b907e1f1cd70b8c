"""Rollouts: the Qwen3.5 JetStream engine and its gRPC server, and the trainer's side of them:
one step's draw from the served policy (`draw`) and draws ahead of the train step (`prefetch`).

JetStream is imported only by `engine`, `orchestrator` and `serve`; `sampling` and `capacity`
load without it, so the trainer stays light. The token client, which the harness's agent
processes use, lives in envs/harness/jetstream_client.py; the wire format both sides speak in
envs/jetstream_wire.py.
JetStream is installed without seqio and TensorFlow (`seqio_standin`).
"""
from rl.rollout import seqio_standin

seqio_standin.install_if_missing()
