"""Coverage-guided fuzzing with atheris (libFuzzer) of the byte- and text-level entry points, beside the
hypothesis targets of tests/test_fuzz.py. Not collected by pytest; ``make fuzz`` runs each target:

    python tests/fuzz_atheris.py decode|config|overrides -runs=10000

A target passes when every input ends in a value or the project's typed error; any other exception is
a crash that libFuzzer reports with the input that caused it (and a non-zero exit).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["pipeline"]):
    from config import ConfigError, load_config
    from pipeline.records import (
        FeederPosition,
        GroupClosed,
        PromptTask,
        RecordError,
        Trajectory,
        decode,
        encode,
        pack_f32,
        pack_i32,
    )

_CONFIG = Path(tempfile.mkdtemp(prefix="rollstream-atheris-")) / "fuzz.toml"


def fuzz_decode(data: bytes) -> None:
    try:
        record = decode(data)
    except RecordError:
        return
    if decode(encode(record)) != record:
        raise AssertionError(f"{record!r} does not round-trip")


def fuzz_config(data: bytes) -> None:
    _CONFIG.write_bytes(data)
    try:
        load_config(_CONFIG)
    except ConfigError:
        pass


def fuzz_overrides(data: bytes) -> None:
    provider = atheris.FuzzedDataProvider(data)
    overrides = [provider.ConsumeUnicodeNoSurrogates(40) for _ in range(provider.ConsumeIntInRange(0, 4))]
    try:
        load_config(None, ["reward.reward_funcs=['accuracy']", *overrides])
    except ConfigError:
        pass


TARGETS = {"decode": fuzz_decode, "config": fuzz_config, "overrides": fuzz_overrides}


def seed_corpus(target: str) -> Path:
    """Valid inputs for libFuzzer to mutate from: encoded records, the shipped configs, typical --set lines."""
    corpus = Path(tempfile.mkdtemp(prefix=f"rollstream-atheris-{target}-"))
    if target == "decode":
        seeds = [
            encode(
                PromptTask(
                    prompt_id="e0:1",
                    generation_batch=0,
                    num_generations=4,
                    messages=[{"role": "user", "content": "1+1?"}],
                    resume_at=FeederPosition(),
                )
            ),
            encode(GroupClosed(prompt_id="e0:1", attempt=0, generation_batch=0, record_ids=["e0:1/0/0/0"])),
            encode(
                Trajectory(
                    prompt_id="e0:1",
                    attempt=0,
                    request_id="e0:1/0/0",
                    generation_batch=0,
                    prompt_ids=pack_i32([1, 2]),
                    completion_ids=pack_i32([3]),
                    logprobs=pack_f32([-0.5]),
                    rollout_infos={"num_turns": 2},
                    policy_version=0,
                    max_policy_version=1,
                )
            ),
        ]
    elif target == "config":
        seeds = [
            path.read_bytes() for path in sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
        ]
    else:
        seeds = [b"\x02grpo.num_generations=4", b"\x01data.columns.query=prompt"]
    for i, seed in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(seed)
    return corpus


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(TARGETS)}}} [libFuzzer flags, e.g. -runs=10000]")
    name = sys.argv.pop(1)
    atheris.Setup([*sys.argv, str(seed_corpus(name))], TARGETS[name])
    atheris.Fuzz()
