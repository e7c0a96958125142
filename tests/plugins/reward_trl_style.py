"""Reward functions in TRL's style (its GRPO docs, "Using a custom reward function"), called as TRL's
trainer calls them: every argument by keyword. Each writes what it received as one JSON line to
``$ROLLSTREAM_REWARD_PROBE`` (tests/test_reward_kwargs.py reads it)."""

import json
import os
import re

from rewards import orms
from rewards.scoring import conversational


def probe(func, **seen):
    with open(os.environ["ROLLSTREAM_REWARD_PROBE"], "a") as f:
        f.write(json.dumps({"func": func, **seen}) + "\n")


def trl_logging(prompts, completions, completion_ids, solution, trainer_state, log_extra=None, log_metric=None,
                **kwargs):
    """TRL's examples 1 and 6: lengths from completion_ids, the gold answer logged as a column, a metric."""
    probe("trl_logging", prompts=prompts, completions=completions, completion_ids=completion_ids,
          global_step=trainer_state.global_step, kwargs=sorted(kwargs))
    log_extra("golden_answer", list(solution))
    log_extra("completion_tokens", [len(ids) for ids in completion_ids])
    log_metric("trl_probe_metric", 0.25)
    return [float(len(ids)) for ids in completion_ids]


def reward_func(completion_ids, **kwargs):
    """TRL's example 1, as written: ``completion_ids`` first, ``completions`` only in kwargs."""
    probe("trl_ids_first", completion_ids=completion_ids, has_completions="completions" in kwargs)
    return [float(len(ids)) for ids in completion_ids]


@conversational
def format_reward_func(completions, **kwargs):
    """TRL's example 2 (conversational format): ``completions[i][0]["content"]``."""
    probe("trl_conversational", completions=completions, prompts=kwargs["prompts"],
          completion_ids=kwargs["completion_ids"])
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, completion[0]["content"]) else 0.0 for completion in completions]


async def async_reward_func(prompts, completions, **kwargs):
    """TRL's example 5: an async function, ``prompts`` first."""
    probe("trl_async", prompts=prompts, completions=completions)
    return [0.0] * len(completions)


orms["trl_logging"] = trl_logging
orms["trl_ids_first"] = reward_func
orms["trl_conversational"] = format_reward_func
orms["trl_async"] = async_reward_func
