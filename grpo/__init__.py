"""Pure GRPO math: losses, advantages, the batch plan and statistics. Numbers in, numbers out; no I/O."""
