"""``code_execution``: run the completion's program against the row's test cases, in the sandbox.

The row carries its tests as ms-swift's / open-r1's ``verification_info`` column::

    {"language": "python", "test_cases": [{"type": "stdin_stdout", "input": "2 3\\n", "output": "5\\n"}]}

The program is the last fenced code block of the completion (```python ... ``` as ms-swift extracts it;
an unlabelled fence counts too). The reward is the fraction of test cases whose stdout matches the
expected output (trailing whitespace ignored per line), as ms-swift's ``code_reward``. Anything the
program does wrong — no code, a crash, a timeout, too much memory or output, a refused syscall — is a
failed test with a reason (counted in ``rollstream_reward_sandbox_runs_total{outcome}``), never an
error of the reward: the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from pipeline import metrics
from rewards.registry import ORM, orms
from rewards.sandbox import SandboxLimits, SandboxResult, run_python

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced code block of a completion ("" when there is none)."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else ""


def outputs_match(actual: str, expected: str) -> bool:
    """Pure: equal up to trailing whitespace on each line and blank lines at the end."""

    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return norm(actual) == norm(expected)


def test_cases_of(verification_info: Any) -> list[dict[str, str]]:
    """The stdin/stdout test cases of a row's ``verification_info`` (a dict, or its JSON text)."""
    info = json.loads(verification_info) if isinstance(verification_info, str) else verification_info
    if not isinstance(info, dict) or not isinstance(info.get("test_cases"), list):
        raise TypeError(
            "code_execution: verification_info must be a table with a test_cases list, "
            'e.g. {"language": "python", "test_cases": [{"input": "1\\n", "output": "2\\n"}]}'
        )
    language = info.get("language", "python")
    if language != "python":
        raise ValueError(f"code_execution runs python only; verification_info.language is {language!r}")
    return info["test_cases"]


class CodeExecution(ORM):
    """Fraction of the row's test cases the completion's program passes (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        r = config.reward
        self.limits = SandboxLimits(
            timeout_s=r.code_timeout_s,
            memory_mb=r.code_memory_mb,
            max_output_bytes=r.code_max_output_bytes,
            max_file_bytes=r.code_max_file_bytes,
        )
        self.runs = asyncio.Semaphore(r.executor_workers)  # sandboxes at once, per worker
        self.run = config.run.name

    async def __call__(
        self, completions: list[str], verification_info: list[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        if verification_info is None:
            raise ValueError("code_execution needs a 'verification_info' column with the test cases")
        return list(await asyncio.gather(*(self.score(c, v) for c, v in zip(completions, verification_info))))

    async def score(self, completion: str, verification_info: Any) -> float | None:
        if verification_info is None:
            return None
        cases = test_cases_of(verification_info)
        code = extract_code(completion)
        if not code or not cases:
            metrics.SANDBOX_RUNS.labels(self.run, "no_code" if not code else "no_tests").inc()
            return 0.0
        results = await asyncio.gather(*(self.check(code, case) for case in cases))
        return sum(results) / len(cases)

    async def check(self, code: str, case: dict[str, str]) -> bool:
        async with self.runs:
            result: SandboxResult = await run_python(code, str(case.get("input", "")), self.limits)
        passed = result.ok and outputs_match(result.stdout, str(case.get("output", "")))
        outcome = result.reason or ("passed" if passed else "wrong_answer")
        metrics.SANDBOX_RUNS.labels(self.run, outcome).inc()
        return passed


orms["code_execution"] = CodeExecution
