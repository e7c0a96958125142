"""A reward plugin that fails for one request, always, and the settings that use it: the dead-letter runs
(tests/test_ledger.py, in one process; tests/test_chaos.py, as Procfile workers) load it by path.

``poison_one`` raises for the request named by ``$ROLLSTREAM_POISON_REQUEST`` on every call (a retry or a
redelivery to another reward worker fails too), and is not applicable (None) to every other request.
Under ``reward.on_error = "dead_letter"`` exactly that request's group entry is dead-lettered (the rollout
sends a group as one entry, scored with one call per function: ``dead_entry``).
"""

import json
import os
from pathlib import Path

from rewards import orms

POISON_ENV = "ROLLSTREAM_POISON_REQUEST"
SETTINGS = [  # --set lines: this plugin's reward beside the demo's; dead_letter: its group entry goes dead
    f"run.external_plugins=[{json.dumps(str(Path(__file__).resolve()))}]",
    'reward.reward_funcs=["accuracy", "format", "poison_one"]',
    "reward.reward_weights=[1.0, 0.2, 1.0]",
    'reward.on_error="dead_letter"',
    "reward.max_retries=0",
]


def poison_one(completions, request_id, **kwargs):
    target = os.environ.get(POISON_ENV)
    if target in request_id:
        raise RuntimeError(f"poisoned request {target}")
    return [None] * len(completions)


orms["poison_one"] = poison_one


def first_group_request(cfg) -> str:
    """Request 1 of the run's first prompt group, in the feeder's own order: a group surely released."""
    from data.loading import load_rows
    from stages.feeder import Feeder

    return f"{Feeder(cfg, load_rows(cfg)).release_batch()[0].group_id}/1"


def dead_entry(request_id: str) -> str:
    """The record id of the entry a poisoned request sends to the dead edge: its group's TrajectoryGroup."""
    return f"{request_id.rsplit('/', 1)[0]}/group"
