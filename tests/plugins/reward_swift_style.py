"""Reward plugins in ms-swift's style (its ``plugin.py`` and reward-function docs): ORM classes called as
ms-swift's trainer calls them, ``reward_func(completions, **reward_kwargs)``. Each writes what it received
as one JSON line to ``$ROLLSTREAM_REWARD_PROBE`` (tests/test_reward_kwargs.py reads it)."""

import json
import os

from rewards import ORM, orms


def probe(func, **seen):
    with open(os.environ["ROLLSTREAM_REWARD_PROBE"], "a") as f:
        f.write(json.dumps({"func": func, **seen}) + "\n")


class TurnCounter(ORM):
    """Reads ``messages`` (the scheduler's whole conversation), as a multi-turn ORM does."""

    def __call__(self, completions, solution, **kwargs):
        messages = kwargs["messages"]
        probe(
            "swift_messages",
            kwargs=sorted(kwargs),
            completions=completions,
            solution=solution,
            messages=messages,
            response_token_ids=kwargs["response_token_ids"],
            completion_ids=kwargs["completion_ids"],
            finish_reason=kwargs["finish_reason"],
            is_truncated=kwargs["is_truncated"],
            request_id=kwargs["request_id"],
            prompt_id=kwargs["prompt_id"],
            rollout_infos=kwargs["rollout_infos"],
            trajectory_inputs=kwargs["trajectory_inputs"],
        )
        return [float(sum(m["role"] == "assistant" for m in conv)) for conv in messages]


class StepAware(ORM):
    """Reads ``trainer_state`` as ms-swift's plugin.py does (``kwargs.get('trainer_state').global_step``)."""

    def __call__(self, completions, **kwargs):
        state = kwargs.get("trainer_state")
        probe("swift_state", global_step=state.global_step, max_steps=state.max_steps, epoch=state.epoch,
              n=len(completions))
        return [0.0] * len(completions)


class AsyncLength(ORM):
    """An async ORM (ms-swift >= 3.12 ``AsyncORM``: ``async def __call__``)."""

    async def __call__(self, completions, **kwargs):
        probe("swift_async", completions=completions, kwargs=sorted(kwargs))
        return [float(len(c)) for c in completions]


orms["swift_messages"] = TurnCounter
orms["swift_state"] = StepAware
orms["swift_async"] = AsyncLength
