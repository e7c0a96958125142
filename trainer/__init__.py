"""The public, synchronous trainer the learner stage shells: model loading, log-probs, the training loop,
checkpoints and the distributed protocol (weight snapshots are ``weights.snapshots``)."""
