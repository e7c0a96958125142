"""An OpenEnv environment (openenv-core's own style: pydantic Action/Observation/State, an ``Environment`` on
the server, an ``EnvClient`` over its WebSocket) and the TRL ``environment_factory`` class that uses it as
TRL's OpenEnv docs show: ``reset`` resets the remote episode, a public method steps it with an Action.

The server runs with uvicorn (``python -m uvicorn openenv_calc:app``), started by the test on a loopback port;
the class finds it through CALC_ENV_URL, as TRL's examples close over their ``--env-url``."""

from __future__ import annotations

import os
from typing import Any
from uuid import uuid4

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class AddAction(Action):
    a: int = Field(..., description="first number")
    b: int = Field(..., description="second number")


class AddObservation(Observation):
    result: int | None = None
    question: str = ""


class AddState(State):
    target: int = 0


class AddEnvironment(Environment):
    """The server side: an episode holds a question; a step adds two numbers and rewards the right sum."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = AddState(episode_id=str(uuid4()))

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> AddObservation:
        self._state = AddState(episode_id=episode_id or str(uuid4()), target=int(kwargs.get("target", 0)))
        return AddObservation(question="Use the add tool.", done=False, reward=0.0)

    def step(self, action: AddAction, timeout_s: float | None = None, **kwargs: Any) -> AddObservation:
        self._state.step_count += 1
        result = action.a + action.b
        return AddObservation(result=result, done=True, reward=float(result == self._state.target))

    @property
    def state(self) -> AddState:
        return self._state


app = create_app(AddEnvironment, AddAction, AddObservation, env_name="add", max_concurrent_envs=64)


class AddEnvClient(EnvClient[AddAction, AddObservation, AddState]):
    def _step_payload(self, action: AddAction) -> dict[str, Any]:
        return {"a": action.a, "b": action.b}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[AddObservation]:
        observation = AddObservation(**payload.get("observation", {}), done=payload.get("done", False),
                                     reward=payload.get("reward"))
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> AddState:
        return AddState(**payload)


class AddToolEnv:
    """TRL's environment_factory class over the OpenEnv client (one WebSocket session per instance)."""

    def __init__(self) -> None:
        self.client = AddEnvClient(base_url=os.environ["CALC_ENV_URL"]).sync()
        self.reward = 0.0
        self.calls = 0

    def reset(self, **kwargs) -> str | None:
        self.client.reset(target=int(kwargs["solution"]))
        self.reward = 0.0
        self.calls = 0
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.

        Returns:
            The sum of a and b.
        """
        result = self.client.step(AddAction(a=a, b=b))
        self.calls += 1
        self.reward = float(result.reward or 0.0)
        return result.observation.result

    def close(self) -> None:
        self.client.close()
