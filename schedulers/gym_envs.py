"""Built-in environments (``envs``): ``guess_number`` and ``gridworld`` (a text FrozenLake).

Both are deterministic given their ``env_config`` (a ``seed`` or explicit ``target`` / ``map``); without a
seed they derive one from the request id, so a trajectory replays identically (in process or behind
``rollstream env-serve``).
"""

from __future__ import annotations

import random
import re
import zlib
from collections import deque
from typing import Any

from schedulers.gym import Env, envs
from schedulers.protocol import Messages, RolloutInferRequest

_INTEGER = re.compile(r"-?\d+")
_MOVE = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)
_MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def _config_int(config: dict[str, Any], key: str, default: int, low: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        bound = f" >= {low}" if low is not None else ""
        raise ValueError(f"env_config.{key}={value!r} must be an integer{bound}")
    return value


def _seed(config: dict[str, Any], request: RolloutInferRequest) -> int:
    if config.get("seed") is not None:
        return _config_int(config, "seed", 0)
    return zlib.crc32((request.uuid or "").encode())  # stable across processes, unlike hash()


class GuessNumberEnv(Env):
    """``guess_number``: find a hidden integer in [low, high]; each wrong guess is answered "higher" or
    "lower". Reward 1 on finding it (done), minus ``step_penalty`` for every other step.

    env_config: ``low`` (1), ``high`` (8), ``seed`` or ``target``, ``step_penalty`` (0.0).
    """

    system_prompt = "Find the hidden number. Reply with one number."

    def __init__(self, env_config: dict[str, Any]) -> None:
        super().__init__(env_config)
        self.low = _config_int(env_config, "low", 1)
        self.high = _config_int(env_config, "high", 8)
        if self.high < self.low:
            raise ValueError(f"env_config: high={self.high} must be >= low={self.low}")
        self.step_penalty = float(env_config.get("step_penalty", 0.0))
        self.target: int | None = None

    async def reset(self, config: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        if self.env_config.get("target") is not None:
            self.target = _config_int(self.env_config, "target", self.low)
        else:
            self.target = random.Random(_seed(self.env_config, config)).randint(self.low, self.high)
        return (
            f"Guess a number between {self.low} and {self.high}.",
            {"target": self.target},
            self.system_prompt,
        )

    async def step(self, action: Messages) -> tuple[str, float, bool, dict[str, Any]]:
        found = _INTEGER.findall(action[-1]["content"])
        if not found:
            return (
                f"Reply with a number between {self.low} and {self.high}.",
                0.0 - self.step_penalty,
                False,
                {"guess": None},
            )
        guess, target = int(found[-1]), self.target
        assert target is not None, "reset() sets the target before the first step"
        if guess == target:
            return "Correct.", 1.0, True, {"guess": guess, "found": True}
        return (
            ("higher" if target > guess else "lower"),
            0.0 - self.step_penalty,
            False,
            {"guess": guess},
        )

    async def close(self) -> None:
        pass


def generate_map(size: int, frozen_prob: float, rng: random.Random) -> list[str]:
    """A ``size`` x ``size`` FrozenLake map (S top-left, G bottom-right, H holes) with a path from S to G
    (Gymnasium's generate_random_map: draw until the breadth-first search finds one)."""
    while True:
        grid = [["F" if rng.random() < frozen_prob else "H" for _ in range(size)] for _ in range(size)]
        grid[0][0], grid[-1][-1] = "S", "G"
        if _reachable(grid):
            return ["".join(row) for row in grid]


def _reachable(grid: list[list[str]] | list[str]) -> bool:
    size = len(grid)
    seen, queue = {(0, 0)}, deque([(0, 0)])
    while queue:
        r, c = queue.popleft()
        if grid[r][c] == "G":
            return True
        for dr, dc in _MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < size and 0 <= nc < len(grid[nr]) and (nr, nc) not in seen and grid[nr][nc] != "H":
                seen.add((nr, nc))
                queue.append((nr, nc))
    return False


class GridWorldEnv(Env):
    """``gridworld``: a text FrozenLake. The player P starts on S and must reach G without stepping into a
    hole H; the reply names a move (up, down, left or right; the last one written counts). Reward
    ``goal_reward`` (1.0) on reaching G, ``-step_penalty`` (0.01) for every other step; a hole ends it.

    env_config: ``map`` (rows of S/F/H/G) or ``size`` (4), ``frozen_prob`` (0.8) and ``seed``;
    ``step_penalty``, ``goal_reward``.
    """

    system_prompt = (
        "You walk on a frozen lake. Reach G, avoid holes H. Reply with one move: up, down, left or right."
    )

    def __init__(self, env_config: dict[str, Any]) -> None:
        super().__init__(env_config)
        self.size = _config_int(env_config, "size", 4, low=2)
        self.frozen_prob = float(env_config.get("frozen_prob", 0.8))
        if not 0.0 < self.frozen_prob <= 1.0:
            raise ValueError(f"env_config.frozen_prob={self.frozen_prob} must be in (0, 1]")
        self.step_penalty = float(env_config.get("step_penalty", 0.01))
        self.goal_reward = float(env_config.get("goal_reward", 1.0))
        self.grid: list[str] = []
        self.position = (0, 0)

    async def reset(self, config: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        if self.env_config.get("map") is not None:
            self.grid = [str(row) for row in self.env_config["map"]]
            if not self.grid or any(len(row) != len(self.grid[0]) for row in self.grid):
                raise ValueError(f"env_config.map={self.grid!r} must be equal-length rows of S/F/H/G")
        else:
            self.grid = generate_map(
                self.size, self.frozen_prob, random.Random(_seed(self.env_config, config))
            )
        starts = [(r, row.index("S")) for r, row in enumerate(self.grid) if "S" in row]
        if not starts or not any("G" in row for row in self.grid):
            raise ValueError(f"env_config.map={self.grid!r} needs one S and one G")
        self.position = starts[0]
        return self.render(), {"map": self.grid}, self.system_prompt

    def render(self) -> str:
        rows = [list(row) for row in self.grid]
        r, c = self.position
        rows[r][c] = "P"
        return "\n".join("".join(row) for row in rows)

    async def step(self, action: Messages) -> tuple[str, float, bool, dict[str, Any]]:
        moves = _MOVE.findall(action[-1]["content"])
        if not moves:
            return (
                f"{self.render()}\nInvalid move. Reply up, down, left or right.",
                0.0 - self.step_penalty,
                False,
                {"move": None},
            )
        move = moves[-1].lower()
        dr, dc = _MOVES[move]
        r, c = self.position[0] + dr, self.position[1] + dc
        if 0 <= r < len(self.grid) and 0 <= c < len(self.grid[0]):
            self.position = (r, c)
        cell = self.grid[self.position[0]][self.position[1]]
        if cell == "G":
            return self.render(), self.goal_reward, True, {"move": move, "status": "goal"}
        if cell == "H":
            return self.render(), 0.0 - self.step_penalty, True, {"move": move, "status": "hole"}
        return self.render(), 0.0 - self.step_penalty, False, {"move": move, "status": "moved"}

    async def close(self) -> None:
        pass


envs["guess_number"] = GuessNumberEnv
envs["gridworld"] = GridWorldEnv
