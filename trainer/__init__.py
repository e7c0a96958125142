"""The public, synchronous trainer the learner stage shells: model loading, log-probs, the training loop,
checkpoints, weight snapshots and the distributed protocol."""
