"""A plugin file in ms-swift main's (v4) style: the import block of its examples/train/grpo/plugin/plugin.py
(written for this test), whose reward classes take ``args`` (ms-swift's GRPO arguments); loaded unchanged by
tests/test_swift_compat.py."""
# ruff: noqa: F401, I001, UP006, UP035 - ms-swift's own style (its import block, typing.List), kept on purpose
import os
import sys
from typing import List

import torch

from swift.infer_engine import RequestConfig, TransformersEngine
from swift.infer_engine.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RolloutInferRequest
from swift.rewards import ORM, AsyncORM, orms, rm_plugins
from swift.rewards.rm_plugin import DefaultRMPlugin
from swift.rollout.gym_env import Env, envs
from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns
from swift.template import Template
from swift.utils import get_logger, to_device

sys.path.insert(0, os.path.dirname(__file__))
from swift_probe import record  # the test's recorder, next to this file

logger = get_logger()


class LengthBudget(ORM):
    """Reads its settings from ``args`` as ms-swift 4's built-ins do."""

    def __init__(self, args=None, **kwargs):
        super().__init__(args, **kwargs)
        from swift.rewards.orm import MathAccuracy

        self.acc = MathAccuracy(args=args)
        names = [
            "max_completion_length", "num_generations", "beta", "temperature", "soft_max_length",
            "soft_cache_length", "cosine_max_len", "repetition_n_grams", "reward_funcs",
        ]
        record("main_args", event="built", args={name: getattr(self.args, name) for name in names})

    def __call__(self, completions, solution, **kwargs) -> List[float]:
        budget = self.args.max_completion_length
        record("main_args", event="called", n=len(completions))
        return [a * (1.0 if len(c) <= budget else 0.5) for a, c in zip(self.acc(completions, solution), completions)]


orms["main_args"] = LengthBudget
