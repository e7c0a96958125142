"""A Sudoku OpenEnv server in the shape of TextArena's ``Sudoku-v0`` (what ms-swift's OpenEnv example plays),
small enough to run in the tests: openenv-core's own ``create_app`` serving an ``Environment`` over its
WebSocket, a 9x9 board with a few empty cells, moves ``[row col number]`` in the action's ``message``, the
game log growing in the observation's ``prompt`` (and its one ``messages`` entry), TextArena's words for a
rejected move ("Invalid move ... Please resubmit a valid move to avoid penalties."), reward 1.0 when solved,
the game lost after 3 invalid moves.

Run with uvicorn (``python -m uvicorn openenv_sudoku:app``) on a loopback port; reset(blanks=, seed=) picks
the empty cells. With OPENENV_SUDOKU_LOG set, each session's reset / step / close is appended there as a
JSON line, so a test can check that every episode's session was closed."""

from __future__ import annotations

import json
import os
import random
import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

SOLUTION = [
    [5, 3, 4, 6, 7, 8, 9, 1, 2],
    [6, 7, 2, 1, 9, 5, 3, 4, 8],
    [1, 9, 8, 3, 4, 2, 5, 6, 7],
    [8, 5, 9, 7, 6, 1, 4, 2, 3],
    [4, 2, 6, 8, 5, 3, 7, 9, 1],
    [7, 1, 3, 9, 2, 4, 8, 5, 6],
    [9, 6, 1, 5, 3, 7, 2, 8, 4],
    [2, 8, 7, 4, 1, 9, 6, 3, 5],
    [3, 4, 5, 2, 8, 6, 1, 7, 9],
]
MAX_INVALID = 3


class SudokuAction(Action):
    message: str = Field(..., description="the move, [row col number]")


class SudokuObservation(Observation):
    prompt: str = ""
    messages: list[dict[str, Any]] = Field(default_factory=list)


class SudokuState(State):
    invalid_moves: int = 0


def render(grid: list[list[int]]) -> str:
    """TextArena's board: a C1..C9 header, rows R1..R9, '.' for empty, '|' between boxes."""
    lines = ["   C1 C2 C3   C4 C5 C6   C7 C8 C9"]
    for r, row in enumerate(grid):
        cells = [str(v) if v else "." for v in row]
        lines.append(f"R{r + 1}  " + "  ".join(cells[0:3]) + " | " + "  ".join(cells[3:6]) + " | "
                     + "  ".join(cells[6:9]))
        if r in (2, 5):
            lines.append("   " + "- " * 16)
    return "\n".join(lines)


def _log(event: str, **fields: Any) -> None:
    path = os.environ.get("OPENENV_SUDOKU_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, **fields}) + "\n")


class SudokuEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = SudokuState(episode_id=str(uuid4()))
        self.grid = [row[:] for row in SOLUTION]
        self.log = ""

    def _observation(self, done: bool, reward: float) -> SudokuObservation:
        return SudokuObservation(prompt=self.log, messages=[{"category": "game", "content": self.log}],
                                 done=done, reward=reward)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SudokuObservation:
        self._state = SudokuState(episode_id=episode_id or str(uuid4()))
        rng = random.Random(seed)
        self.grid = [row[:] for row in SOLUTION]
        for cell in rng.sample(range(81), int(kwargs.get("blanks", 3))):
            self.grid[cell // 9][cell % 9] = 0
        self.log = ("[GAME] You are Player 0 in Sudoku. Fill the empty cells ('.'); submit a move as "
                    "[row col number].\nCurrent board:\n" + render(self.grid))
        _log("reset", episode=self._state.episode_id)
        return self._observation(False, 0.0)

    def step(self, action: SudokuAction, timeout_s: float | None = None, **kwargs: Any) -> SudokuObservation:
        self._state.step_count += 1
        _log("step", episode=self._state.episode_id, message=action.message)
        reason = self._play(action.message)
        if reason:
            self._state.invalid_moves += 1
            if self._state.invalid_moves >= MAX_INVALID:
                self.log += f"\n[GAME] Invalid move: {reason}. Player 0 lost the game."
                return self._observation(True, 0.0)
            self.log += f"\n[GAME] Invalid move: {reason}. Please resubmit a valid move to avoid penalties."
            return self._observation(False, 0.0)
        solved = all(all(row) for row in self.grid)
        self.log += "\n[GAME] Board state:\n" + render(self.grid)
        return self._observation(solved, 1.0 if solved else 0.0)

    def _play(self, message: str) -> str | None:
        """The reason a move is rejected, or None once it is placed."""
        match = re.fullmatch(r"\[\s*(\d)\s+(\d)\s+(\d)\s*\]", message.strip())
        if not match:
            return "expected [row col number]"
        r, c, n = (int(x) for x in match.groups())
        if not (1 <= r <= 9 and 1 <= c <= 9 and 1 <= n <= 9):
            return "rows, columns and numbers are 1-9"
        r, c = r - 1, c - 1
        if self.grid[r][c]:
            return f"cell R{r + 1} C{c + 1} is already filled"
        box = [self.grid[i][j] for i in range(r // 3 * 3, r // 3 * 3 + 3) for j in range(c // 3 * 3, c // 3 * 3 + 3)]
        if n in self.grid[r] or n in [row[c] for row in self.grid] or n in box:
            return f"{n} at R{r + 1} C{c + 1} is a rule violation"
        self.grid[r][c] = n
        return None

    @property
    def state(self) -> SudokuState:
        return self._state

    def close(self) -> None:
        _log("close", episode=self._state.episode_id)


app = create_app(SudokuEnvironment, SudokuAction, SudokuObservation, env_name="sudoku", max_concurrent_envs=64)
