"""The pipeline's edges (stream names) and which stage's consumer group reads each.

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
