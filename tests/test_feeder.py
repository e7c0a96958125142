"""Feeder's pure parts: run length, epoch order, admission control, and the tasks of a batch."""

import types

import pytest

from stages.feeder import Feeder, admitted, epoch_order, plan_batches, truncate_prompt


def cfg(max_steps=0, epochs=1, pbs=4, spg=2, gas=1, iters=1, k=1):
    return types.SimpleNamespace(
        grpo=types.SimpleNamespace(prompt_batch_size=pbs, steps_per_generation=spg, gradient_accumulation_steps=gas,
                                   num_iterations=iters, num_generations=8, max_staleness=k),
        data=types.SimpleNamespace(num_train_epochs=epochs, dataset_shuffle=True, data_seed=None),
        run=types.SimpleNamespace(max_steps=max_steps, seed=3),
    )


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


def test_batch_tasks_cover_each_epoch_exactly_once():
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "solution": str(i)} for i in range(8)]
    feeder = Feeder(cfg(epochs=2, pbs=4, k=1), rows)
    epoch0 = [t for b in range(2) for t in feeder.batch_tasks(b)]
    assert sorted(t.prompt_id for t in epoch0) == sorted(f"e0:{i}" for i in range(8))
    t = feeder.batch_tasks(3)[0]
    assert t.generation_batch == 3 and t.min_policy_version == 2 and t.num_generations == 8
    assert t.data_dict["solution"] == rows[int(t.prompt_id.split(":")[1])]["solution"]
    seeds = {x.seed for b in range(4) for x in feeder.batch_tasks(b)}
    assert len(seeds) == 16  # distinct sampling seeds per group


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


def test_a_zero_std_drop_comes_back_as_the_next_attempt_of_the_same_batch():
    import asyncio

    from pipeline.records import Feedback

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "solution": str(i)} for i in range(8)]
    feeder = Feeder(cfg(pbs=4, k=1), rows)
    dropped = Feedback(prompt_id="e0:5", attempt=1, generation_batch=1, outcome="dropped", reason="zero_std")
    [(edge, task)] = asyncio.run(feeder.handle(dropped, None)).outputs
    assert (edge, task.prompt_id, task.attempt, task.generation_batch) == ("prompts", "e0:5", 2, 1)
    assert task.messages == rows[5]["messages"]
