"""The built-in rewards, under ms-swift's names and with its parameters (``reward.*`` in the config):
``accuracy``, ``format``, ``react_format``, ``cosine``, ``repetition``, ``soft_overlong``, ``env_reward``
(``code_execution`` lives in ``rewards/code.py``).

Each follows ms-swift's definition (swift/plugin/orm.py); where we differ, the docstring says why. The
classes also go by ms-swift's class names (``MathAccuracy``, ``CosineReward``, ...) and take its
constructor arguments in both forms: ms-swift 3's, in its order (``SoftOverlong(soft_max_length,
soft_cache_length)``), and ms-swift 4's ``args=`` (``SoftOverlong(args=args)``, by keyword, as ms-swift 4
builds them), so a plugin that builds or subclasses them runs unchanged. An explicit argument wins over
``args``; without either, ms-swift 3's defaults.
"""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction
from typing import Any

from rewards.registry import ORM, orms

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BARE_NUMBER = re.compile(r"\s*-?\d+(?:\.\d+)?\s*")
# ms-swift's ``format``: the R1 layout, nothing after </answer>.
_THINK_ANSWER = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>(?![\s\S])", re.DOTALL | re.MULTILINE)
# ms-swift's ``react_format``: a thought, then a ReAct tool call.
_REACT = re.compile(r"^<think>.*?</think>\s*Action:.*?Action Input:.*?$", re.DOTALL | re.MULTILINE)


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (``"7+5 = 12."`` -> 12; ``"1,000"`` -> 1000), exactly."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def extract_answer(completion: str) -> str:
    """The part of a completion that holds its answer: the first ``<answer>...</answer>`` if any, else all."""
    tagged = _ANSWER_TAG.search(completion)
    return tagged.group(1).strip() if tagged else completion


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


@functools.cache
def _latex_answer_config() -> list:
    # ms-swift's MathAccuracy: without an <answer> tag, only a LaTeX/boxed answer counts.
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    # boxed=True is ms-swift's value; latex2sympy2_extended (1.11) types it "all" | "last" | "none" and reads True
    # as "none" (the boxed content is extracted by LatexExtractionConfig already): kept, to score as ms-swift does.
    normalization = NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                        boxed=True, units=True)  # pyright: ignore[reportArgumentType]
    return [
        LatexExtractionConfig(
            normalization_config=normalization, boxed_match_priority=0, try_extract_without_anchor=False
        )
    ]


@functools.lru_cache(maxsize=4096)
def _parse_gold(text: str) -> list:
    """A gold answer parsed once: every completion of a group (and every epoch) shares its solution."""
    from math_verify import parse

    # parsing_timeout/timeout_seconds None: math-verify's own timeout uses SIGALRM, which only works in
    # the main thread; reward.timeout_s bounds the call instead.
    return parse(text, extraction_mode="first_match", parsing_timeout=None)  # pyright: ignore[reportArgumentType]  (None: no SIGALRM)


def answer_matches(completion: str, solution: Any) -> bool:
    """Pure: does the completion's answer equal the solution? (ms-swift's ``accuracy``, with fallbacks)

    As ms-swift: the gold is ``solution`` (its ``<answer>`` part if tagged) parsed by math-verify; the
    completion's ``<answer>`` part is parsed the same way, an untagged completion only for a LaTeX or
    ``\\boxed{}`` answer; equivalence is math-verify's ``verify``. Two fallbacks ms-swift lacks:
    an untagged completion with no LaTeX answer (``"7+5 = 12"``, the built-in arithmetic task) is
    compared by its last number, exactly; a gold that does not parse (``"Paris"``) is compared as a
    whitespace- and case-normalised string.
    """
    from math_verify import parse, verify

    gold_text = extract_answer(str(solution))
    gold = _parse_gold(gold_text)
    answer_text = extract_answer(completion)
    if not gold:
        return _normalize(answer_text) == _normalize(gold_text)
    if _ANSWER_TAG.search(completion):
        answer = parse(answer_text, extraction_mode="first_match", parsing_timeout=None)  # pyright: ignore[reportArgumentType]  (None: no SIGALRM)
    else:
        answer = parse(
            completion, extraction_config=_latex_answer_config(), extraction_mode="first_match",
            parsing_timeout=None,  # pyright: ignore[reportArgumentType]  (None: no SIGALRM)
        )
    if not answer:
        expected = last_number(gold_text)
        return expected is not None and last_number(answer_text) == expected
    try:
        return bool(verify(gold, answer, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - as ms-swift: an answer math-verify cannot compare is wrong
        return False


class Accuracy(ORM):
    """1.0 when the completion's answer equals ``solution`` (see ``answer_matches``), else 0.0;
    None for rows without a solution."""

    required_columns = ("solution",)  # every row must carry one (data/loading.py checks at load)

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        super().__init__(args)
        import logging

        # math-verify warns on every call that its SIGALRM timeout is off (we bound calls ourselves).
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        # Import and warm math-verify/sympy now, at stage construction: the first call would otherwise
        # hold the GIL for ~1 s of imports while the event loop needs it.
        answer_matches("$1$", "1")

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

    Accepted: ms-swift's R1 layout ``<think>...</think><answer>...</answer>`` with nothing after it, or
    (our addition, for the built-in arithmetic task, which asks for the number alone) a bare number.
    """

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        return [float(bool(_BARE_NUMBER.fullmatch(c) or _THINK_ANSWER.match(c))) for c in completions]


class ReactFormat(ORM):
    """1.0 for ``<think>...</think>`` followed by ``Action: ... Action Input: ...``, else 0.0 (as ms-swift)."""

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        return [float(bool(_REACT.match(c))) for c in completions]


def _given(args: Any, params: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """Each constructor argument: the explicit value, else ``args``' attribute of that name, else the default."""
    return {
        name: value if value is not None else getattr(args, name, default) if args is not None else default
        for name, (value, default) in params.items()
    }


def cosine_scaled(length: int, max_len: int, value_at_zero: float, value_at_max: float) -> float:
    """Pure: the cosine schedule of arXiv 2502.03373 (ms-swift's ``cosfn``): ``value_at_zero`` at length 0,
    ``value_at_max`` at ``max_len``, half-way at ``max_len / 2``; not clipped beyond ``max_len``, as ms-swift."""
    return value_at_max - (value_at_max - value_at_zero) * (1 + math.cos(length * math.pi / max_len)) / 2


class Cosine(ORM):
    """Length-dependent accuracy (ms-swift's ``cosine``): correct answers earn more when short
    (cosine_min_len_value_correct -> cosine_max_len_value_correct), wrong ones are punished less when long
    (cosine_min_len_value_wrong -> cosine_max_len_value_wrong); length in completion tokens."""

    required_columns = ("solution",)

    def __init__(
        self,
        cosine_min_len_value_wrong: float | None = None,
        cosine_max_len_value_wrong: float | None = None,
        cosine_min_len_value_correct: float | None = None,
        cosine_max_len_value_correct: float | None = None,
        cosine_max_len: int | None = None,
        accuracy_orm: Any = None,
        *,
        args: Any = None,
        **kwargs: Any,
    ) -> None:
        # ms-swift 4 reads args.cosine_*, ms-swift 3 takes them as arguments (those win); else ms-swift 3's defaults.
        super().__init__(args)
        given = _given(
            self.args,
            {
                "cosine_min_len_value_wrong": (cosine_min_len_value_wrong, -0.5),
                "cosine_max_len_value_wrong": (cosine_max_len_value_wrong, 0.0),
                "cosine_min_len_value_correct": (cosine_min_len_value_correct, 1.0),
                "cosine_max_len_value_correct": (cosine_max_len_value_correct, 0.5),
                "cosine_max_len": (cosine_max_len, 1000),
            },
        )
        self.min_len_value_wrong = given["cosine_min_len_value_wrong"]
        self.max_len_value_wrong = given["cosine_max_len_value_wrong"]
        self.min_len_value_correct = given["cosine_min_len_value_correct"]
        self.max_len_value_correct = given["cosine_max_len_value_correct"]
        self.max_len = given["cosine_max_len"]
        self.accuracy = accuracy_orm or Accuracy()

    def __call__(
        self, completions: list[str], completion_ids: list[list[int]], solution: list[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        rewards: list[float | None] = []
        for ids, correct in zip(completion_ids, self.accuracy(completions, solution=solution)):
            if correct is None:
                rewards.append(None)
            elif correct >= 1.0:
                rewards.append(cosine_scaled(len(ids), self.max_len, self.min_len_value_correct, self.max_len_value_correct))
            else:
                rewards.append(cosine_scaled(len(ids), self.max_len, self.min_len_value_wrong, self.max_len_value_wrong))
        return rewards


def repetition_penalty(text: str, n_grams: int, max_penalty: float) -> float:
    """Pure: ``max_penalty * (1 - unique n-grams / n-grams)`` over lower-cased words (ms-swift's
    ``repetition``); 0.0 for text with fewer than ``n_grams`` words."""
    words = text.lower().split()
    if len(words) < n_grams:
        return 0.0
    grams = list(zip(*(words[i:] for i in range(n_grams))))
    return (1 - len(set(grams)) / len(grams)) * max_penalty


class Repetition(ORM):
    """ms-swift's ``repetition`` penalty (arXiv 2502.03373), see ``repetition_penalty``."""

    def __init__(
        self,
        repetition_n_grams: int | None = None,
        repetition_max_penalty: float | None = None,
        *,
        args: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(args)
        given = _given(
            self.args,
            {
                "repetition_n_grams": (repetition_n_grams, 3),
                "repetition_max_penalty": (repetition_max_penalty, -1.0),
            },
        )
        self.n_grams = given["repetition_n_grams"]
        self.max_penalty = given["repetition_max_penalty"]

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        return [repetition_penalty(c, self.n_grams, self.max_penalty) for c in completions]


def soft_overlong_penalty(length: int, soft_max_length: int, soft_cache_length: int) -> float:
    """Pure: DAPO's soft overlong punishment (ms-swift's ``soft_overlong``): 0 up to
    ``soft_max_length - soft_cache_length`` tokens, then falling linearly to -1 at ``soft_max_length``."""
    expected = soft_max_length - soft_cache_length
    return min(-(length - expected) / soft_cache_length, 0.0)


class SoftOverlong(ORM):
    """DAPO soft overlong punishment over completion tokens, see ``soft_overlong_penalty``."""

    def __init__(
        self,
        soft_max_length: int | None = None,
        soft_cache_length: int | None = None,
        *,
        args: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(args)
        given = _given(
            self.args,
            {
                "soft_max_length": (soft_max_length, None),
                "soft_cache_length": (soft_cache_length, None),
            },
        )
        if given["soft_cache_length"] is None or given["soft_max_length"] is None:
            raise ValueError("soft_overlong needs reward.soft_cache_length (e.g. soft_cache_length = 128)")
        if given["soft_cache_length"] >= given["soft_max_length"]:  # as ms-swift's assert
            raise ValueError(
                f"soft_overlong: soft_cache_length={given['soft_cache_length']} must be below "
                f"soft_max_length={given['soft_max_length']}"
            )
        self.soft_max_length = given["soft_max_length"]
        self.soft_cache_length = given["soft_cache_length"]

    def __call__(self, completions: list[str], completion_ids: list[list[int]], **kwargs: Any) -> list[float | None]:
        return [soft_overlong_penalty(len(ids), self.soft_max_length, self.soft_cache_length) for ids in completion_ids]


class EnvReward(ORM):
    """``env_reward``: a gym rollout's environment reward, the sum of its step rewards
    (``rollout_infos["total_reward"]``, ms-swift's gym reward column). The default reward with
    ``rollout.use_gym_env``; combine it with others through ``reward_weights``."""

    def __call__(self, completions: list[str], rollout_infos: list[dict[str, Any]] | None = None,
                 **kwargs: Any) -> list[float | None]:
        infos = rollout_infos or [{}] * len(completions)
        if not any("total_reward" in (info or {}) for info in infos):
            raise ValueError("env_reward: no trajectory has an environment reward (rollout_infos['total_reward']); "
                             "it needs rollout.use_gym_env = true")
        return [float(info["total_reward"]) if "total_reward" in (info or {}) else None for info in infos]


orms["accuracy"] = Accuracy
orms["format"] = Format
orms["react_format"] = ReactFormat
orms["cosine"] = Cosine
orms["repetition"] = Repetition
orms["soft_overlong"] = SoftOverlong
orms["env_reward"] = EnvReward

# ms-swift's class names (swift.plugin.orm / swift.rewards.orm), for plugins that build or subclass them.
# MathORM (ms-swift: opencompass' MATH checker) is the same check as MathAccuracy here.
MathAccuracy = MathORM = Accuracy
ReActFormat = ReactFormat
CosineReward = Cosine
RepetitionPenalty = Repetition
