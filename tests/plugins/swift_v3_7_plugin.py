"""A plugin file in ms-swift v3.7.3's style: the import block of its examples/train/grpo/plugin/plugin.py
(written for this test), which defines its own MathAccuracy; loaded unchanged by tests/test_swift_compat.py."""
# ruff: noqa: F401, I001, UP006, UP035 - ms-swift's own style (its import block, typing.List), kept on purpose
import os
import re
import sys
from typing import List

import torch

from swift.llm import PtEngine, RequestConfig, Template, to_device
from swift.llm.infer.protocol import ChatCompletionResponse
from swift.plugin import ORM, orms, rm_plugins
from swift.plugin.context_manager import ContextManager, context_managers
from swift.plugin.env import Env, envs
from swift.plugin.multi_turn import MultiTurnScheduler, multi_turns
from swift.plugin.rm_plugin import DefaultRMPlugin
from swift.utils import get_logger

sys.path.insert(0, os.path.dirname(__file__))
from swift_probe import record  # the test's recorder, next to this file

logger = get_logger()


class MathAccuracy(ORM):
    """The plugin's own accuracy: the last number of the completion equals the solution."""

    def __init__(self):
        record("v37_math", event="built")

    def __call__(self, completions, solution, **kwargs) -> List[float]:
        rewards = []
        for content, sol in zip(completions, solution):
            numbers = re.findall(r"-?\d+", content)
            rewards.append(float(bool(numbers) and numbers[-1] == str(sol).strip()))
        record("v37_math", event="called", n=len(completions))
        return rewards


orms["v37_math"] = MathAccuracy
