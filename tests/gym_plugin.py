# ruff: noqa: UP006, UP035 - typing.Dict/Tuple as ms-swift's plugins write them: the point is "unchanged"
"""An ms-swift gym plugin (env + context manager), unchanged but for its imports: ms-swift's
``from swift.plugin import ContextManager, Env, context_managers, envs`` became ``from schedulers import ...``.
The tests load it by path (run.external_plugins) and read CLOSES / RESETS to see every env's lifecycle.

env_config keys: ``done_at`` (the step that ends it, reward 1.0), ``raise_at`` / ``hang_at`` (a step that
raises / never returns), ``raise_on_reset``.
"""

import asyncio
import itertools
import threading
from copy import deepcopy
from typing import Any, Dict, Tuple

from schedulers import ContextManager, Env, RolloutInferRequest, context_managers, envs

_IDS = itertools.count()
CLOSES: Dict[str, int] = {}  # env id -> close() calls
RESETS: Dict[str, str] = {}  # env id -> the request's uuid
STEP_STARTED: Dict[str, asyncio.Event] = {}  # request uuid -> set when a step begins
STEP_THREADS: Dict[str, bool] = {}  # env id -> did a sync step run off the event loop's thread?
LIVE = {"now": 0, "peak": 0}  # envs between reset and close


class CountingEnv(Env):
    """Asks for a number every turn; each step rewards 0.25 (1.0 on the done_at step)."""

    def __init__(self, env_config):
        super().__init__(env_config)
        self.env_id = f"env-{next(_IDS)}"  # not id(self): a collected env's id is reused
        self.steps = 0
        self.uuid = None

    async def reset(self, config: RolloutInferRequest) -> Tuple[str, Dict[str, Any], str]:
        self.uuid = config.uuid
        RESETS[self.env_id] = config.uuid
        LIVE["now"] += 1
        LIVE["peak"] = max(LIVE["peak"], LIVE["now"])
        if self.env_config.get("raise_on_reset"):
            raise RuntimeError("reset failed on purpose")
        return "Say a number.", {"uuid": config.uuid}, "You count."

    async def step(self, action) -> Tuple[str, float, bool, Dict[str, Any]]:
        self.steps += 1
        STEP_STARTED.setdefault(self.uuid, asyncio.Event()).set()
        if self.env_config.get("raise_at") == self.steps:
            raise ValueError(f"step {self.steps} failed on purpose")
        if self.env_config.get("hang_at") == self.steps:
            await asyncio.Event().wait()  # never set: only the timeout (or a cancel) ends it
        done = self.env_config.get("done_at") == self.steps
        reply = action[-1]["content"]
        return f"Step {self.steps} done. Say a number.", 1.0 if done else 0.25, done, {"reply": reply}

    async def close(self):
        CLOSES[self.env_id] = CLOSES.get(self.env_id, 0) + 1
        LIVE["now"] -= 1


class SyncCountingEnv(CountingEnv):
    """The same with plain (sync) methods: they must run in a thread, off the event loop."""

    def reset(self, config):
        RESETS[self.env_id] = config.uuid
        return "Say a number.", {"uuid": config.uuid}, "You count."

    def step(self, action):
        self.steps += 1
        STEP_THREADS[self.env_id] = threading.current_thread() is not threading.main_thread()
        done = self.env_config.get("done_at") == self.steps
        return (
            f"Step {self.steps} done. Say a number.",
            1.0 if done else 0.25,
            done,
            {"reply": action[-1]["content"]},
        )

    def close(self):
        CLOSES[self.env_id] = CLOSES.get(self.env_id, 0) + 1


class LastTurnContextManager(ContextManager):
    """Keeps the system prompt and the newest observation only (a history compressor, as ms-swift's examples)."""

    def manage_context(self, history, trajectory_id):
        history = deepcopy(history)
        if len(history) <= 2:
            return history
        return [history[0], history[-1]]


class RecordingContextManager(ContextManager):
    """Leaves the history as it is and records the trajectory ids it was called with (MANAGED)."""

    def manage_context(self, history, trajectory_id):
        MANAGED.append(trajectory_id)
        return history


MANAGED: list = []  # trajectory ids RecordingContextManager saw, one per call

envs["counting"] = CountingEnv
envs["sync_counting"] = SyncCountingEnv
context_managers["last_turn"] = LastTurnContextManager
context_managers["recording"] = RecordingContextManager
