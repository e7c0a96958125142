"""code_execution and its sandbox: every escape the issue lists ends in a 0 reward with a reason, and the
worker keeps serving."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from config import config_from_dict
from pipeline import metrics
from rewards import get_reward
from rewards.code import extract_code, outputs_match
from rewards.sandbox import SandboxLimits, network_namespace_prefix, run_python

LIMITS = SandboxLimits(timeout_s=2.0, memory_mb=256, max_output_bytes=10_000)
DOUBLE = {"language": "python", "test_cases": [{"input": "21\n", "output": "42\n"}, {"input": "-2\n", "output": "-4"}]}


def fenced(code: str) -> str:
    return f"Here is my program:\n```python\n{code}\n```\n"


@pytest.fixture(scope="module")
def code_reward():
    cfg = config_from_dict(
        {
            "run": {"name": f"code-{uuid.uuid4().hex[:8]}"},
            "reward": {"reward_funcs": ["code_execution"], "code_timeout_s": 2.0, "code_memory_mb": 256,
                       "code_max_output_bytes": 10_000},
        }
    )
    return get_reward("code_execution", cfg), cfg.run.name


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("```python\na=1\n```\ntext\n```\nb=2\n```") == "b=2\n"
    assert extract_code("no code here") == ""
    assert outputs_match("42  \n\n", "42") and not outputs_match("4 2", "42")


async def test_a_correct_program_passes_every_case(code_reward):
    reward, _ = code_reward
    assert await reward([fenced("print(2 * int(input()))")], verification_info=[DOUBLE]) == [1.0]
    half = fenced("n = int(input())\nprint(42 if n == 21 else 0)")
    assert await reward([half, "no code"], verification_info=[DOUBLE, DOUBLE]) == [0.5, 0.0]
    assert await reward(["x"], verification_info=[None]) == [None]  # no tests: not applicable



ESCAPES = {
    # name: (program, reason)
    "infinite loop": ("while True:\n    pass", "timeout"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "refused"),
    "fork via _posixsubprocess": ("import _posixsubprocess", "refused"),
    "subprocess": ("import subprocess\nsubprocess.run(['ls', '/'])", "refused"),
    "10 GB allocation": ("x = bytearray(10 * 1024**3)\nprint(len(x))", "memory"),
    "parent environment via /proc": ("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())", "refused"),
    "write outside the temp dir": ("open('/tmp/rollstream-escape-{tag}', 'w').write('x')", "refused"),
    "delete outside the temp dir": ("import os\nos.remove('/tmp/rollstream-escape-{tag}')", "refused"),
    "open a socket": ("import socket\nsocket.socket().connect(('127.0.0.1', 6379))", "refused"),
    "flood stdout": ("while True:\n    print('x' * 1000)", "output_limit"),
    "signal the worker": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "refused"),
}


@pytest.mark.parametrize("name", list(ESCAPES))
async def test_escape_attempts_end_in_zero_with_a_reason(name, code_reward):
    reward, run = code_reward
    tag = uuid.uuid4().hex[:8]
    program, reason = ESCAPES[name]
    program = program.replace("{tag}", tag)
    victim = f"/tmp/rollstream-escape-{tag}"
    if "delete" in name:
        Path(victim).touch()
    started = time.monotonic()
    result = await run_python(program, "", LIMITS)
    assert result.reason == reason, (result.reason, result.detail, result.stderr[-300:])
    assert result.detail  # a human-readable why
    assert time.monotonic() - started < LIMITS.timeout_s + 2
    before = metrics.SANDBOX_RUNS.labels(run, reason)._value.get()
    assert await reward([fenced(program)], verification_info=[DOUBLE]) == [0.0]
    assert metrics.SANDBOX_RUNS.labels(run, reason)._value.get() == before + 2  # both test cases
    if "write" in name:
        assert not os.path.exists(victim)
    if "delete" in name:
        assert os.path.exists(victim)
        os.remove(victim)
    # ... and the worker keeps serving.
    assert await reward([fenced("print(2 * int(input()))")], verification_info=[DOUBLE]) == [1.0]


async def test_the_program_sees_an_empty_environment_and_a_fresh_temp_dir(monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_TEST_SECRET", "hunter2")
    program = (
        "import os\nprint(sorted(k for k in os.environ if k != 'LC_CTYPE'))\nprint(os.getcwd())\n"
        "open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())"
    )
    result = await run_python(program, "", LIMITS)
    assert result.ok, result.stderr
    env, cwd, scratch = result.stdout.splitlines()
    assert env == "[]" and scratch == "ok"
    assert os.path.basename(cwd).startswith("rollstream-sandbox-") and not os.path.exists(cwd)  # removed after


@pytest.mark.skipif(not network_namespace_prefix(), reason="no unprivileged network namespaces on this kernel")
def test_the_network_namespace_has_no_route_out():
    """The kernel layer on its own (the audit hook would refuse first): nothing is reachable."""
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket\ntry:\n socket.create_connection(('127.0.0.1', {port}), timeout=2)\n print('open')\nexcept OSError as e:\n print('closed', e.errno)"
        inside = subprocess.run([*network_namespace_prefix(), sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
        outside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
    assert outside.stdout.startswith("open")
    assert inside.stdout.startswith("closed"), inside.stdout + inside.stderr
