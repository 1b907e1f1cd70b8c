"""Rollout serving: the Qwen3.5 JetStream engine, its gRPC server and the token client.

JetStream is imported only by `engine`, `orchestrator` and `serve`; `sampling`, `capacity`,
`protocol` and `client` load without it, so harness processes and the trainer stay light.
JetStream is installed without seqio and TensorFlow (`seqio_standin`).
"""
from rl.rollout import seqio_standin

seqio_standin.install_if_missing()
