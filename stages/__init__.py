"""The five GRPO stages, each a thin shell: buffer, decide, call a public core below it, emit records.

The edge names live in the framework (``pipeline.edges``); they are re-exported here for existing imports.
"""

from pipeline.edges import (  # noqa: F401
    CONSUMER_GROUPS,
    FEEDBACK,
    PROMPTS,
    SCORED,
    STAGE_NAMES,
    TRAIN,
    TRAJECTORIES,
    WEIGHTS,
)
