"""A plugin file in ms-swift v3.12.6's style: the import block of its examples/train/grpo/plugin/plugin.py
(written for this test), loaded unchanged through run.external_plugins by tests/test_swift_compat.py.

Rewards: an ORM built with ms-swift's SoftOverlong arguments (soft_max_length, soft_cache_length), one with
``tokenizer``, and an AsyncORM that builds ms-swift's MathAccuracy lazily; plus a scheduler, an env, a
context manager and a reward-model plugin registered as plugin.py registers them.
"""
# ruff: noqa: F401, I001, UP006, UP035 - ms-swift's own style (its import block, typing.List), kept on purpose
import asyncio
import os
import sys
from typing import List

import torch

from swift.llm import PtEngine, RequestConfig, RolloutInferRequest, Template, to_device
from swift.llm.infer.protocol import ChatCompletionResponse, ChatCompletionResponseChoice
from swift.plugin import ORM, AsyncORM, orms, rm_plugins
from swift.plugin.context_manager import ContextManager, context_managers
from swift.plugin.env import Env, envs
from swift.plugin.multi_turn import MultiTurnScheduler, multi_turns
from swift.plugin.rm_plugin import DefaultRMPlugin
from swift.utils import get_logger

sys.path.insert(0, os.path.dirname(__file__))
from swift_probe import record  # the test's recorder, next to this file

logger = get_logger()


class SoftLengthPenalty(ORM):
    """DAPO's soft overlong penalty, built as ms-swift 3 builds its SoftOverlong (length in characters here)."""

    def __init__(self, soft_max_length, soft_cache_length):
        assert soft_cache_length < soft_max_length
        self.soft_max_length = soft_max_length
        self.soft_cache_length = soft_cache_length
        record("v312_soft", event="built", soft_max_length=soft_max_length, soft_cache_length=soft_cache_length)

    def __call__(self, completions, **kwargs) -> List[float]:
        expected = self.soft_max_length - self.soft_cache_length
        record("v312_soft", event="called", n=len(completions))
        return [min(-(len(c) - expected) / self.soft_cache_length, 0) for c in completions]


class TokenCount(ORM):
    """Reads the run's tokenizer, as ms-swift 3.7's CosineReward(tokenizer, ...) did."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        record("v312_tokenizer", event="built", encoded=tokenizer.encode("12+7", add_special_tokens=False))

    def __call__(self, completions, **kwargs) -> List[float]:
        lengths = [len(self.tokenizer.encode(c, add_special_tokens=False)) for c in completions]
        record("v312_tokenizer", event="called", completions=completions, lengths=lengths)
        return [0.0] * len(completions)


class AsyncAccuracy(AsyncORM):
    """An async reward (ms-swift >= 3.12.1) scoring with ms-swift's MathAccuracy, imported lazily as
    plugin.py's MultiTurnThinkingTips does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from swift.plugin.orm import MathAccuracy

        self.acc = MathAccuracy()

    async def __call__(self, completions, solution, **kwargs) -> List[float]:
        await asyncio.sleep(0)
        scores = self.acc(completions, solution)
        record("v312_async", event="called", completions=completions, solution=solution, scores=scores)
        return scores


class CustomizedRMPlugin(DefaultRMPlugin):
    def __call__(self, inputs, **kwargs):
        return [0.0] * len(inputs)


class NudgeScheduler(MultiTurnScheduler):
    def step(self, infer_request: RolloutInferRequest, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "Are you sure?"})
        return {"infer_request": infer_request}


class CustomEnv(Env):
    pass


class CustomCtxManager(ContextManager):
    def manage_context(self, history, trajectory_id):
        return history


orms["v312_soft"] = SoftLengthPenalty
orms["v312_tokenizer"] = TokenCount
orms["v312_async"] = AsyncAccuracy
rm_plugins["v312_rm"] = CustomizedRMPlugin
multi_turns["v312_nudge"] = NudgeScheduler
envs["v312_env"] = CustomEnv
context_managers["v312_ctx"] = CustomCtxManager
logger.info("v3.12.6-style plugin loaded")
