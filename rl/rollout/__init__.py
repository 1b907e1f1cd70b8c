"""Rollout serving: the Qwen3.5 JetStream engine, its gRPC server and the token client.

JetStream (and TensorFlow behind it) is imported only by `engine`, `orchestrator` and
`serve`; `sampling`, `capacity`, `protocol` and `client` load without it, so harness
processes and the trainer stay light.
"""
