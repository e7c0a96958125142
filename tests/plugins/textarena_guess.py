"""A TextArena game wrapped as TRL's Wordle example wraps its TextArena environment (``environment_factory``):
the game's rules as the reset observation, one tool that plays a move, the reward read from an attribute."""

from __future__ import annotations

import textarena as ta


class GuessTheNumberEnv:
    def __init__(self) -> None:
        self.env = ta.make("GuessTheNumber-v0")
        self.reward = 0.0
        self.done = False
        self.episodes = 0

    def reset(self, **kwargs) -> str | None:
        self.env.reset(num_players=1)
        self.reward = 0.0
        self.done = False
        self.episodes += 1
        _, observation = self.env.get_observation()
        self._seen = observation
        rule = next(line for line in observation.splitlines() if line.startswith("You have to guess"))
        return f" ({rule.strip()})"  # the game's one-line rule (the full text is long for a tiny model)

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: The guessed number, between 1 and 20.

        Returns:
            The game's feedback.
        """
        if self.done:
            raise ValueError("Game over.")
        done, _ = self.env.step(action=f"[{number}]")
        _, observation = self.env.get_observation()
        feedback, self._seen = observation[len(self._seen):], observation
        if done:
            rewards, _ = self.env.close()
            self.reward, self.done = float(rewards[0]), True
        return feedback.strip()
