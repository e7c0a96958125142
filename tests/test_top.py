"""``rollstream top``: snapshot numbers from a transport in a known state, and the rendered table.

Runs on both transports: memory (the fake that implements the protocol) and the real redis-server.
"""

from __future__ import annotations

import io
import uuid

import pytest
from rich.console import Console

from config import config_from_dict
from pipeline.records import Feedback, PromptTask, WeightsPublished, encode
from pipeline.transport import DEFAULT_REDIS_URL, Transport, connect
from rollstream import top


def prompt(i: int) -> PromptTask:
    return PromptTask(
        prompt_id=f"e0:{i}",
        generation_batch=0,
        num_generations=2,
        messages=[{"role": "user", "content": f"what is {i} + {i}?"}],
    )


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.contract)])
async def transport(request) -> Transport:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else DEFAULT_REDIS_URL
    opened = await connect(request.param, run=f"test-top-{uuid.uuid4().hex[:12]}", url=url)
    yield opened
    if request.param == "redis":
        await opened.delete_run()
    await opened.close()


def text_of(table) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(table)
    return console.export_text()


async def test_empty_run(transport) -> None:
    snap = await top.snapshot(transport)
    assert [row["edge"] for row in snap["edges"]] == list(top.EDGE_GROUPS)
    assert all((row["length"], row["lag"], row["pending"]) == (0, 0, 0) for row in snap["edges"])
    assert snap["weights"] is None
    assert "no weights published yet" in text_of(top.render(snap))


async def test_snapshot_counts_where_work_waits(transport) -> None:
    # prompts: 5 produced, rollout-a takes 3 and acks none, then dead-letters one of them.
    await transport.produce("prompts", [encode(prompt(i)) for i in range(5)])
    taken = await transport.consume("prompts", "rollout", "rollout-a", count=3, block_ms=0)
    assert len(taken) == 3
    await transport.dead_letter("prompts", "rollout", taken[0], "poison", "rollout/rollout-a")
    # feedback: 2 produced, nobody has consumed yet (its group does not exist).
    feedback = [
        Feedback(prompt_id=f"e0:{i}", attempt=0, generation_batch=0, outcome="trained") for i in range(2)
    ]
    await transport.produce("feedback", [encode(f) for f in feedback])
    # weights: two versions; top shows the newest.
    for version in (1, 2):
        published = WeightsPublished(version=version, path=f"/tmp/w{version}", step=4 * version)
        await transport.produce("weights", [encode(published)])

    snap = await top.snapshot(transport)
    rows = {row["edge"]: row for row in snap["edges"]}
    assert (rows["prompts"]["length"], rows["prompts"]["lag"], rows["prompts"]["pending"]) == (5, 2, 2)
    assert rows["prompts"]["group"] == "rollout"
    assert rows["prompts"]["consumers"] == {"rollout-a": 2}
    assert rows["prompts"]["oldest_pending_ms"] >= 0
    assert (rows["feedback"]["length"], rows["feedback"]["lag"], rows["feedback"]["pending"]) == (2, 2, 0)
    assert (rows["trajectories"]["length"], rows["trajectories"]["lag"]) == (0, 0)
    assert rows["dead"]["length"] == 1 and rows["dead"]["group"] is None
    assert snap["weights"] == {"version": 2, "step": 8, "final": False, "published_at": 0.0}

    text = text_of(top.render(snap, title="rollstream top — run t"))
    for edge in ("prompts", "trajectories", "scored", "train", "feedback", "dead"):
        assert edge in text
    assert "rollout-a 2" in text
    assert "learner version 2" in text


async def test_final_weights_say_the_run_is_over(transport) -> None:
    await transport.produce(
        "weights", [encode(WeightsPublished(version=7, path="/tmp/w", step=28, final=True))]
    )
    snap = await top.snapshot(transport)
    assert snap["weights"]["version"] == 7 and snap["weights"]["final"] is True
    assert "the run is over" in text_of(top.render(snap))


def test_memory_transport_is_refused(capsys) -> None:
    # Another process cannot see a memory run: one line and exit code 2, not an empty screen.
    cfg = config_from_dict({"reward": {"reward_funcs": ["accuracy"]}, "run": {"name": "x"}, "transport": {"kind": "memory"}})
    assert top.main(cfg, interval=1.0, once=True) == 2
    assert "transport.kind" in capsys.readouterr().err


async def test_stage_table_from_real_metrics_endpoints() -> None:
    import socket

    from pipeline import metrics

    run = f"test-top-stages-{uuid.uuid4().hex[:8]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens here once the socket is closed
    server = await metrics.serve("127.0.0.1", port, lambda: {"ready": True})
    try:
        w = (run, "reward", "reward-1")
        metrics.WORKER_UP.labels(*w).set(1)
        metrics.RECORDS_IN.labels(*w, "trajectories").inc(10)
        metrics.RECORDS_OUT.labels(*w, "scored").inc(8)
        metrics.RECORDS_DEAD.labels(*w, "handler_error").inc(2)
        metrics.RECORDS_IN.labels("another-run", "reward", "x", "trajectories").inc(1000)  # not this run's
        metrics.set_train_gauges(run, {"step": 7, "reward": 0.625, "rewards/accuracy/mean": 0.5, "staleness/mean": 0.25})
        ports = {"reward": port, "learner": port, "rollout": closed}
        first = await top.stage_snapshot("127.0.0.1", ports, run)
        assert first["reward"] == {
            "workers": 1.0, "in": 10.0, "out": 8.0, "dead": 2.0,
            "reward": 0.625, "accuracy": 0.5, "staleness": 0.25, "step": 7.0,
        }
        assert first["rollout"] is None
        metrics.RECORDS_IN.labels(*w, "trajectories").inc(6)  # 6 more in 2 s: 3.0/s
        second = await top.stage_snapshot("127.0.0.1", ports, run)
        text = text_of(top.render_stages(second, first, 2.0))
        reward_line = next(line for line in text.splitlines() if "reward " in line and "│" in line)
        cells = [c.strip() for c in reward_line.split("│") if c.strip()]
        assert cells[:5] == ["reward", "1", "3.0", "0.0", "2"]
        assert "step 7  reward 0.625  accuracy 0.500  staleness 0.25" in text
        assert "no answer" in text  # the rollout port
        assert "-" in text_of(top.render_stages(first, None, 0.0))  # no rate on the first screen
    finally:
        server.close()
        await server.wait_closed()


def test_stage_ports_are_the_workers_ports() -> None:
    from rollstream.cli import stage_port

    def ports_from(port: int):
        return config_from_dict({"reward": {"reward_funcs": ["accuracy"]}, "run": {"metrics_port": port}})

    cfg = ports_from(9400)
    assert top.stage_ports(cfg) == {stage: stage_port(cfg, stage) for stage in top.STAGE_NAMES}
    assert top.stage_ports(ports_from(0)) == {}
