"""The five GRPO stages. Each module holds one stage: a pure-ish ``handle`` core and a small builder.

Edges (stream names) between them, as DESIGN.md draws the pipeline:

    feeder -> PROMPTS -> rollout -> TRAJECTORIES -> reward -> SCORED -> advantage -> TRAIN -> learner
    learner -> WEIGHTS (fan-out: rollout, feeder, every worker) ; learner/advantage -> FEEDBACK -> feeder
"""

PROMPTS = "prompts"
TRAJECTORIES = "trajectories"
SCORED = "scored"
TRAIN = "train"
WEIGHTS = "weights"
FEEDBACK = "feedback"

STAGE_NAMES = ("feeder", "rollout", "reward", "advantage", "learner")

# Edge -> the consumer group that reads it (the consuming stage's name), in pipeline order.
CONSUMER_GROUPS = {PROMPTS: "rollout", TRAJECTORIES: "reward", SCORED: "advantage", TRAIN: "learner", FEEDBACK: "feeder"}
