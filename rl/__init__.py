"""RL post-training: advantages, policy losses, loss reductions, the train step, checkpoints."""
