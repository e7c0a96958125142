"""``rollstream inspect``: completions, dead letters and config, from a run directory and from a run's
streams (memory transport and the real redis-server), rendered once to text."""

from __future__ import annotations

import io
import json
import uuid

import pytest
from rich.console import Console

from pipeline import run_dir
from pipeline.records import (
    PromptTask,
    ScoredTrajectory,
    Trajectory,
    WeightsPublished,
    encode,
    pack_f32,
    pack_i32,
)
from pipeline.transport import DEFAULT_REDIS_URL, Transport, connect
from rollstream import inspect_run
from rollstream.cli import main


def text_of(renderable) -> str:
    console = Console(record=True, width=220, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def scored(i: int, accuracy: float) -> ScoredTrajectory:
    t = Trajectory(
        prompt_id=f"e0:{i}", attempt=0, request_id=f"e0:{i}/0/0", generation_batch=0,
        prompt_ids=pack_i32([1]), completion_ids=pack_i32([2, 3]), logprobs=pack_f32([-1.0, -0.5]),
        messages=[{"role": "user", "content": f"What is {i}+1?"}], completion=f"answer {i + 1}",
        policy_version=3, max_policy_version=3,
    )
    return ScoredTrajectory(trajectory=t, rewards={"accuracy": accuracy, "format": None}, reward=accuracy)


def test_run_dir_shows_the_last_completions_dead_letters_and_config(tmp_path) -> None:
    rows = [
        {"step": i, "policy_version": 1, "prompt": f"What is {i}+1?", "completion": f"answer {i}",
         "rewards": {"accuracy": float(i % 2)}, "reward": float(i % 2), "advantage": 0.5}
        for i in range(15)
    ]
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.toml").write_text('[run]\nname = "inspected"\n')
    dead = {"edge": "prompts", "entry_id": "5-0", "stage": "rollout", "worker": "w1", "deliveries": 6,
            "error": "exceeded max_deliveries=5", "record": "PromptTask e0:4/0"}
    (tmp_path / "dead_letters.jsonl").write_text(json.dumps(dead) + "\n")

    info = inspect_run.from_run_dir(tmp_path, last=4)
    assert [r["completion"] for r in info["completions"]] == ["answer 11", "answer 12", "answer 13", "answer 14"]
    assert info["dead_letters"] == [dead]
    assert 'name = "inspected"' in info["config"]
    text = text_of(inspect_run.render(info))
    assert "last 4 completions" in text and "answer 14" in text and "accuracy 1.000" in text
    assert "1 dead letters" in text and "exceeded max_deliveries=5" in text and "PromptTask e0:4/0" in text
    assert 'name = "inspected"' in text


def test_run_dir_before_the_end_and_not_a_run_dir(tmp_path, capsys) -> None:
    (tmp_path / "completions.jsonl").write_text("")
    info = inspect_run.from_run_dir(tmp_path)
    assert info == {"source": str(tmp_path), "completions": [], "completions_missing": None, "dead_letters": None,
                    "config": None}
    text = text_of(inspect_run.render(info))
    assert "not written yet" in text and "config: not found" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["inspect", str(empty)]) == 2
    assert "is not a run directory" in capsys.readouterr().err


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.contract)])
async def transport(request) -> Transport:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else DEFAULT_REDIS_URL
    opened = await connect(request.param, run=f"test-inspect-{uuid.uuid4().hex[:12]}", url=url)
    yield opened
    if request.param == "redis":
        await opened.delete_run()
    await opened.close()


async def test_streams_show_scored_tail_dead_letters_and_config(transport, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(run_dir, "PAGE", 7)  # walk the edges over several pages
    # 30 scored records; only the last 5 are shown.
    await transport.produce("scored", [encode(scored(i, float(i % 2))) for i in range(30)])
    # One poison entry and one good record given up on, on the prompts edge.
    await transport.produce("prompts", [b"\x00not msgpack", encode(PromptTask(
        prompt_id="e0:7", generation_batch=0, num_generations=2, messages=[{"role": "user", "content": "x"}]))])
    taken = await transport.consume("prompts", "rollout", "rollout-a", count=2, block_ms=0)
    await transport.dead_letter("prompts", "rollout", taken[0], "undecodable: bad msgpack", "rollout/rollout-a")
    await transport.dead_letter("prompts", "rollout", taken[1], "ValueError: no room", "rollout/rollout-a")
    # The newest weights name the output directory, where the run wrote its config.
    (tmp_path / "weights" / "v000002").mkdir(parents=True)
    (tmp_path / "config.toml").write_text('[run]\nname = "from-weights"\n')
    await transport.produce("weights", [encode(WeightsPublished(version=2, path=str(tmp_path / "weights" / "v000002")))])

    info = await inspect_run.from_transport(transport, last=5)
    assert [r["prompt"] for r in info["completions"]] == [f"What is {i}+1?" for i in range(25, 30)]
    assert info["completions"][-1]["rewards"] == {"accuracy": 1.0, "format": None}
    assert [d["error"] for d in info["dead_letters"]] == ["undecodable: bad msgpack", "ValueError: no room"]
    assert info["dead_letters"][0]["record"].startswith("undecodable payload (12 bytes)")
    assert info["dead_letters"][1]["record"] == "PromptTask e0:7/0"
    assert (info["dead_letters"][1]["stage"], info["dead_letters"][1]["worker"]) == ("rollout", "rollout-a")
    assert 'name = "from-weights"' in info["config"]
    text = text_of(inspect_run.render(info))
    assert "2 dead letters" in text and "ValueError: no room" in text and "format -" in text

    path = tmp_path / "dead_letters.jsonl"
    assert await run_dir.write_dead_letters(transport, path) == 2
    assert [json.loads(line)["error"] for line in path.read_text().splitlines()] == [
        "undecodable: bad msgpack", "ValueError: no room"]


@pytest.mark.contract
async def test_cli_reads_a_redis_run(redis_url, capsys) -> None:
    run = f"test-inspect-cli-{uuid.uuid4().hex[:12]}"
    transport = await connect("redis", run=run, url=redis_url)
    try:
        await transport.produce("scored", [encode(scored(i, 1.0)) for i in range(3)])
        import asyncio

        code = await asyncio.to_thread(main, ["inspect", "--redis", redis_url, "--run", run, "--last", "2"])
        assert code == 0
        out = capsys.readouterr().out
        assert "last 2 completions" in out and "What is 2+1?" in out and "What is 0+1?" not in out
        assert "dead letters: none" in out
    finally:
        await transport.delete_run()
        await transport.close()


@pytest.mark.parametrize("argv", [["inspect"], ["inspect", "runs/x", "--redis", "redis://h", "--run", "r"]])
def test_cli_wants_a_run_dir_or_redis_and_run(argv) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
