"""The built-in rewards, under ms-swift's names: ``accuracy`` and ``format``.

math-verify (ms-swift's checker for ``accuracy``) is not a dependency: answers are compared as exact
numbers when the solution holds one, else as normalised strings, which covers the built-in arithmetic
task and GSM8K-style solutions (``"... #### 72"``).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from rewards import ORM, orms

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BARE_NUMBER = re.compile(r"\s*-?\d+(?:\.\d+)?\s*")
# ms-swift's ``format`` reward: the R1 layout, nothing after </answer>.
_THINK_ANSWER = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>(?![\s\S])", re.DOTALL)


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (``"7+5 = 12."`` -> 12; ``"1,000"`` -> 1000), exactly."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def extract_answer(completion: str) -> str:
    """The part of a completion that holds its answer: the last ``<answer>...</answer>`` if any, else all."""
    tagged = _ANSWER_TAG.findall(completion)
    return tagged[-1] if tagged else completion


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def answer_matches(completion: str, solution: Any) -> bool:
    """Pure: does the completion's answer equal the solution?

    If the solution holds a number, the last number of the answer must equal the solution's last
    number (exact rational comparison, so ``12.0`` == ``12``); otherwise the answer must equal the
    solution as a whitespace- and case-normalised string.
    """
    answer = extract_answer(completion)
    expected = last_number(str(solution))
    if expected is not None:
        return last_number(answer) == expected
    return _normalize(answer) == _normalize(str(solution))


class Accuracy(ORM):
    """1.0 when the completion's answer equals ``solution``, else 0.0; None for rows without a solution."""

    def __call__(
        self, completions: list[str], solution: list[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        if solution is None:
            raise ValueError(
                "the accuracy reward needs a 'solution' column in the dataset "
                '(map one with data.columns = {answer = "solution"})'
            )
        if len(solution) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(solution)} solutions")
        return [None if s is None else float(answer_matches(c, s)) for c, s in zip(completions, solution)]


class Format(ORM):
    """1.0 when the completion is in an expected answer format, else 0.0.

    Accepted: a bare number (the built-in arithmetic task: ``"12"``), or ms-swift's R1 layout
    ``<think>...</think><answer>...</answer>`` with nothing after it.
    """

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        return [float(bool(_BARE_NUMBER.fullmatch(c) or _THINK_ANSWER.match(c))) for c in completions]


orms["accuracy"] = Accuracy
orms["format"] = Format
