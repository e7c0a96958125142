"""A verifiers 0.4 (v1 API) environment in the layout ``vf-init rollstream-add`` scaffolds: small sums asked
in plain text, built in memory (no Hub dataset), scored by an exact-answer reward. rollstream's test of its
verifiers bridge (tests/test_verifiers_bridge.py) runs it unchanged."""

import random

import verifiers.v1 as vf


class RollstreamAddData(vf.TaskData):
    """One sum: the prompt asks it, ``answer`` is the reference."""

    answer: str


class RollstreamAddTask(vf.Task[RollstreamAddData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the final reply is exactly the sum (surrounding whitespace aside), else 0."""
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class RollstreamAddConfig(vf.TasksetConfig):
    num_tasks: int = 8
    """How many tasks to build."""
    max_operand: int = 9
    """Operands are drawn from 0..max_operand."""
    seed: int = 0
    """Seed of the operands: the same knobs always build the same tasks."""


class RollstreamAddTaskset(vf.Taskset[RollstreamAddTask, RollstreamAddConfig]):
    def load(self) -> list[RollstreamAddTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            data = RollstreamAddData(id=f"add-{i}", prompt=f"What is {a}+{b}?", answer=str(a + b))
            tasks.append(RollstreamAddTask(data, self.config.task))
        return tasks
