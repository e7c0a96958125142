"""Feeder's pure parts: run length, epoch order, admission control, and the tasks of a batch."""

import asyncio
import uuid

import pytest
from fake_context import FakeContext

from config import config_from_dict
from pipeline.records import Feedback, FeederPosition, WeightsPublished, decode, encode
from pipeline.stage import Handled
from pipeline.transport.memory import MemoryTransport
from pipeline.worker import Worker
from stages import FEEDBACK, PROMPTS, WEIGHTS
from stages.feeder import Feeder, admitted, epoch_order, plan_batches, truncate_prompt


def cfg(max_steps=0, epochs=1, pbs=4, spg=2, gas=1, iters=1, k=1, truncation="left", max_length=None):
    """A real config whose generation batch is ``pbs`` prompts of 8 generations, in ``spg`` mini-batches."""
    return config_from_dict({
        "reward": {"reward_funcs": ["accuracy"]},
        "grpo": {"num_generations": 8, "per_device_train_batch_size": pbs * 8 // spg, "steps_per_generation": spg,
                 "gradient_accumulation_steps": gas, "num_iterations": iters, "max_staleness": k,
                 "truncation_strategy": truncation},
        "data": {"num_train_epochs": epochs, "dataset_shuffle": True, "max_length": max_length},
        "run": {"max_steps": max_steps, "seed": 3, "name": "feed"},
    })


def test_plan_from_epochs_drops_the_last_partial_batch():
    plan = plan_batches(cfg(epochs=2), dataset_size=18)
    assert plan.batches_per_epoch == 4 and plan.num_batches == 8 and plan.optimizer_steps_per_batch == 2


def test_plan_from_max_steps_rounds_up_to_whole_batches():
    assert plan_batches(cfg(max_steps=5), dataset_size=18).num_batches == 3
    assert plan_batches(cfg(max_steps=5, spg=4, gas=2, iters=2), dataset_size=18).optimizer_steps_per_batch == 4


def test_plan_rejects_a_dataset_smaller_than_one_batch():
    with pytest.raises(ValueError, match="prompt_batch_size"):
        plan_batches(cfg(pbs=8), dataset_size=5)


def test_epoch_order_is_seeded_and_differs_per_epoch():
    assert epoch_order(10, 0, 1, True) == epoch_order(10, 0, 1, True)
    assert epoch_order(10, 0, 1, True) != epoch_order(10, 1, 1, True)
    assert sorted(epoch_order(10, 1, 1, True)) == list(range(10))
    assert epoch_order(5, 0, 1, False) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("b,version,k,ok", [(0, 0, 0, True), (1, 0, 0, False), (1, 0, 1, True), (3, 1, 1, False), (3, 2, 1, True)])
def test_admission(b, version, k, ok):
    assert admitted(b, version, k) is ok


def rows_of(n):
    return [{"messages": [{"role": "user", "content": f"q{i}"}], "solution": str(i)} for i in range(n)]


def release_all(feeder, batches):
    return [t for _ in range(batches) for t in feeder.release_batch()]


def test_batches_cover_each_epoch_exactly_once_and_drop_the_last_partial_batch():
    rows = rows_of(10)  # 2 batches of 4 per epoch; 2 rows per epoch are dropped
    feeder = Feeder(cfg(epochs=2, pbs=4, k=1), rows)
    tasks = release_all(feeder, 4)
    for epoch in (0, 1):
        ids = [t.prompt_id for t in tasks[epoch * 8 : epoch * 8 + 8]]
        assert all(i.startswith(f"e{epoch}:") for i in ids) and len(set(ids)) == 8
        assert ids == [f"e{epoch}:{r}" for r in epoch_order(10, epoch, 3, True)[:8]]  # the seeded order
    t = tasks[12]
    assert (t.generation_batch, t.min_policy_version, t.num_generations, t.attempt) == (3, 2, 8, 0)
    assert t.data_dict["solution"] == rows[int(t.prompt_id.split(":")[1])]["solution"]
    assert len({x.seed for x in tasks}) == 16  # distinct sampling seeds per group
    assert feeder.position == FeederPosition(batch=4, slot=0, cursor=18)  # epoch 1 starts at 10


def test_a_dropped_group_is_replaced_by_the_next_prompt_of_the_order_never_a_used_one():
    feeder = Feeder(cfg(pbs=4, k=1), rows_of(12))
    first = feeder.release_batch()
    dropped = Feedback(prompt_id=first[1].prompt_id, attempt=0, generation_batch=0, outcome="dropped", reason="zero_std")
    again = Feedback(prompt_id=first[1].prompt_id, attempt=0, generation_batch=0, outcome="dropped", reason="zero_std")
    assert asyncio.run(feeder.handle(dropped, FakeContext(stage="feeder"))).hold  # held until the replacement goes out
    assert asyncio.run(feeder.handle(again, FakeContext(stage="feeder"))) == Handled()  # a redelivery: answered once
    replacement = feeder.replacement(dropped)
    assert replacement.prompt_id == f"e0:{epoch_order(12, 0, 3, True)[4]}"
    assert (replacement.generation_batch, replacement.attempt) == (0, 1)
    assert replacement.resume_at == FeederPosition(batch=1, slot=0, cursor=5)
    second = feeder.release_batch()
    ids = [t.prompt_id for t in first + [replacement] + second]
    assert len(set(ids)) == len(ids) == 9


def test_only_a_drop_of_a_group_the_feeder_released_is_replaced():
    """A drop's ids may come from a dead-lettered payload: made-up or mismatched ones get no replacement,
    before or after a restart (then judged by the prompt's stream position)."""
    feeder = Feeder(cfg(pbs=4, k=1, epochs=2), rows_of(10))
    batch0 = feeder.release_batch()

    def drop(prompt_id, attempt=0, batch=0):
        return Feedback(prompt_id=prompt_id, attempt=attempt, generation_batch=batch, outcome="dropped",
                        reason="dead_letter")

    assert feeder.released(drop(batch0[2].prompt_id))
    unreleased = f"e0:{epoch_order(10, 0, 3, True)[4]}"  # the next prompt of the order, not yet taken
    made_up = [drop("poison"), drop("e0:99"), drop("e-1:2"), drop("e0:"), drop(unreleased),
               drop(batch0[2].prompt_id, attempt=1), drop(batch0[2].prompt_id, batch=1)]
    assert not any(feeder.released(d) for d in made_up)
    ctx = Worker(feeder, MemoryTransport(), run="feed").ctx
    assert all(asyncio.run(feeder.handle(d, ctx)) == Handled() for d in made_up)
    restarted = Feeder(cfg(pbs=4, k=1, epochs=2), rows_of(10))
    restarted.restart_at(feeder.position)
    assert restarted.released(drop(batch0[2].prompt_id))  # sent before the restart: by its position
    assert not restarted.released(drop(unreleased)) and not restarted.released(drop(batch0[2].prompt_id, batch=2))
    replacement = restarted.replacement(drop(batch0[2].prompt_id))
    assert replacement.prompt_id == unreleased and restarted.released(drop(unreleased, attempt=1))


def test_a_restarted_feeder_continues_where_the_newest_task_says():
    straight = Feeder(cfg(pbs=4, k=1, epochs=3), rows_of(10))
    expected = [t.prompt_id for t in release_all(straight, 4)]
    first = Feeder(cfg(pbs=4, k=1, epochs=3), rows_of(10))
    produced = first.release_batch() + first.release_batch()[:3]  # died after 3 tasks of batch 1
    second = Feeder(cfg(pbs=4, k=1, epochs=3), rows_of(10))
    second.position = produced[-1].resume_at
    rest = second.release_batch() + release_all(second, 2)
    assert [t.prompt_id for t in produced + rest] == expected
    assert [t.generation_batch for t in rest] == [1, 2, 2, 2, 2, 3, 3, 3, 3]


def test_truncation_delete_skips_long_prompts_and_counts_them():
    rows = rows_of(12)
    rows[5]["messages"] = [{"role": "user", "content": "x" * 50}]
    c = cfg(pbs=4, truncation="delete", max_length=10)
    feeder = Feeder(c, rows, prompt_length=lambda messages: len(messages[0]["content"]))
    ids = [t.prompt_id for t in release_all(feeder, 2)]
    assert "e0:5" not in ids and len(set(ids)) == 8 and feeder.skipped_too_long == 1
    with pytest.raises(ValueError, match="data.max_length=1"):
        Feeder(cfg(pbs=4, truncation="delete", max_length=1), rows, prompt_length=lambda messages: len(messages[0]["content"])).release_batch()


@pytest.fixture(params=["memory", "redis"])
async def transport(request):
    if request.param == "memory":
        yield MemoryTransport()
        return
    from pipeline.transport import connect

    t = await connect("redis", run=f"feeder-test-{uuid.uuid4().hex[:8]}", url=request.getfixturevalue("redis_url"),
                      maxlen=4)  # a tiny bound: trimming runs, and must keep the newest task
    try:
        yield t
    finally:
        await t.delete_run()
        await t.close()


async def test_feeder_worker_answers_drops_atomically_and_resumes_after_a_crash(transport):
    """Real worker runtime on both transports: admission by version, a held drop answered with its
    replacement, then the worker dies (cancelled: nothing more acked) and a new one takes over."""
    c = cfg(pbs=2, k=0, epochs=4)
    rows = rows_of(6)

    async def prompts_out(n):
        async with asyncio.timeout(20):
            while len(await transport.read(PROMPTS, "0", 100, 0)) < n:
                await asyncio.sleep(0.01)  # poll interval inside a deadline

    def start(feeder):
        w = Worker(feeder, transport, run="feed", block_ms=20, min_idle_ms=50)
        return asyncio.create_task(w.serve())

    running = start(Feeder(c, rows))
    await prompts_out(2)  # batch 0 only: the learner is at version 0 and max_staleness = 0
    first = decode((await transport.read(PROMPTS, "0", 1, 0))[0].payload)
    drop = Feedback(prompt_id=first.prompt_id, attempt=0, generation_batch=0, outcome="dropped", reason="staleness")
    # A drop of a group the feeder never released (a poison record's made-up ids) is acked, not replaced.
    made_up = Feedback(prompt_id="x", attempt=0, generation_batch=0, outcome="dropped", reason="dead_letter")
    await transport.produce(FEEDBACK, [encode(made_up), encode(drop)])
    await prompts_out(3)
    await transport.produce(WEIGHTS, [encode(WeightsPublished(version=1, path="-"))])
    await prompts_out(5)
    running.cancel()  # the crash
    with pytest.raises(asyncio.CancelledError):
        await running
    assert (await transport.stats(FEEDBACK, "feeder")).pending == 0  # acked with the replacement
    running = start(Feeder(c, rows))
    await transport.produce(WEIGHTS, [encode(WeightsPublished(version=2, path="-"))])
    await prompts_out(7)
    await transport.produce(WEIGHTS, [encode(WeightsPublished(version=3, path="-", final=True))])
    assert await asyncio.wait_for(running, 20) == 0
    tasks = [decode(d.payload) for d in await transport.read(PROMPTS, "0", 100, 0)]
    assert [(t.generation_batch, t.attempt) for t in tasks] == [(0, 0), (0, 0), (0, 1), (1, 0), (1, 0), (2, 0), (2, 0)]
    ids = [t.prompt_id for t in tasks]
    assert len(set(ids)) == 7  # nothing repeated across the restart
    order = [f"e{p // 6}:{epoch_order(6, p // 6, 3, True)[p % 6]}" for p in range(8)]
    # Nothing skipped: batch 0, the replacement, batch 1, then batch 2 starts epoch 1 (drop_last: one
    # prompt of epoch 0 was left, fewer than a batch).
    assert ids == order[:5] + order[6:8]


def test_truncate_prompt_left_keeps_the_last_tokens():
    assert truncate_prompt([1, 2, 3, 4, 5], 3, "left") == [3, 4, 5]
    assert truncate_prompt([1, 2, 3], 3, "left") == [1, 2, 3]  # at the cap: unchanged
    assert truncate_prompt([1, 2, 3, 4, 5], None, "left") == [1, 2, 3, 4, 5]  # no cap


def test_truncate_prompt_delete_drops_only_prompts_over_the_cap():
    assert truncate_prompt([1, 2, 3, 4], 3, "delete") is None
    assert truncate_prompt([1, 2, 3], 3, "delete") == [1, 2, 3]
    assert truncate_prompt([1, 2, 3, 4], None, "delete") == [1, 2, 3, 4]


def test_truncate_prompt_rejects_an_unknown_strategy():
    with pytest.raises(ValueError, match="right"):
        truncate_prompt([1, 2], 1, "right")


def test_a_checkpointed_batch_start_restarts_the_stream_exactly():
    straight = Feeder(cfg(pbs=4, k=1, epochs=3), rows_of(10))
    expected = [t.prompt_id for t in release_all(straight, 4)]
    first = Feeder(cfg(pbs=4, k=1, epochs=3), rows_of(10))
    release_all(first, 3)  # batches 0..2 out; say batch 1 was the last trained
    resumed = Feeder(cfg(pbs=4, k=1, epochs=3), rows_of(10))
    resumed.restart_at(first.batch_starts[2])
    assert [t.prompt_id for t in release_all(resumed, 2)] == expected[8:]
