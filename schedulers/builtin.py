"""Built-in schedulers, as ms-swift's plugin examples (``swift/plugin/multi_turn.py``, ``examples/train/grpo/plugin``):

- ``math_tip_trick``: continuation style; a wrong answer is cut at ``<answer>``/``</think>`` and the tip
  "But wait... It seems I made a mistake," is written into the same assistant message (mask 0).
- ``math_tip_trick_multi_turn``: new-turn style; a wrong answer gets the tip as a new user message.
- ``thinking_tips_scheduler``: one record per turn; the history of each turn keeps only the last reasoning.
- ``tool_call_scheduler``: a ReAct calculator call (``Action: calculator`` / ``Action Input: 3*4``) is run in
  a subprocess with a timeout; its observation is inserted into the reply with mask 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import re
import sys
from typing import Any

from rewards.builtin import answer_matches
from schedulers.base import MultiTurnScheduler
from schedulers.protocol import (
    ChatCompletionResponseChoice,
    Messages,
    RequestConfig,
    RolloutInferRequest,
    extract_logprobs,
)


def _default_accuracy(completions: list[str], solutions: list[Any]) -> list[float]:
    return [float(answer_matches(c, s)) for c, s in zip(completions, solutions)]


class MathTipsScheduler(MultiTurnScheduler):
    """``math_tip_trick``: give a wrong answer one tip, inside the same assistant message."""

    tips_prompt = "But wait... It seems I made a mistake,"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acc_func = kwargs.get("acc_function") or _default_accuracy

    def check_finished(self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice,
                       current_turn: int) -> bool:
        last_completion = infer_request.messages[-1]["content"]
        if self.tips_prompt in last_completion:  # one tip only
            return True
        solution = infer_request.data_dict.get("solution")
        if solution is not None and self.acc_func([last_completion], [solution])[0] == 1:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice,
             current_turn: int) -> dict[str, Any]:
        ids = list(response_choice.token_ids or [])
        logprobs = extract_logprobs(response_choice)
        if ids and ids[-1] == self.tokenizer.eos_token_id:  # the message goes on after the tip
            ids, logprobs = ids[:-1], logprobs[:-1]
        completion = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min([completion.index(tag) for tag in ("<answer>", "</think>") if tag in completion] or [len(completion)])
        if cut < len(completion):
            keep = _tokens_covering(self.tokenizer, ids, cut)
            ids, logprobs = ids[:keep], logprobs[:keep]
            completion = self.tokenizer.decode(ids, skip_special_tokens=True)
        tips = self.tokenizer.encode(self.tips_prompt, add_special_tokens=False)
        # This turn's reply in the assistant message becomes the cut reply plus the tip.
        message = infer_request.messages[-1]
        reply = response_choice.message.content
        before = message["content"][: len(message["content"]) - len(reply)] if message["content"].endswith(reply) else ""
        message["content"] = before + completion + self.tips_prompt
        return {
            "infer_request": infer_request,
            "response_token_ids": ids + tips,
            "response_loss_mask": [1] * len(ids) + [0] * len(tips),
            "rollout_logprobs": logprobs,
        }


def _tokens_covering(tokenizer: Any, ids: list[int], chars: int) -> int:
    """The fewest leading tokens whose text reaches ``chars`` characters (ms-swift's progressive decode)."""
    for i in range(1, len(ids) + 1):
        if len(tokenizer.decode(ids[:i], skip_special_tokens=True)) >= chars:
            return i
    return len(ids)


class MathTipsMultiTurnScheduler(MultiTurnScheduler):
    """``math_tip_trick_multi_turn``: give a wrong answer one tip, as a new user turn."""

    tips_prompt = "The answer is not correct, It seems You made a mistake, you need to recheck very carefully."

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acc_func = kwargs.get("acc_function") or _default_accuracy

    def check_finished(self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice,
                       current_turn: int) -> bool:
        if self.tips_prompt in infer_request.messages[-2]["content"]:  # one tip only
            return True
        solution = infer_request.data_dict.get("solution")
        if solution is not None and self.acc_func([response_choice.message.content], [solution])[0] == 1:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice,
             current_turn: int) -> dict[str, Any]:
        infer_request.messages.append({"role": "user", "content": self.tips_prompt})
        return {"infer_request": infer_request}


class ThinkingModelTipsScheduler(MathTipsMultiTurnScheduler):
    """``thinking_tips_scheduler``: as ``math_tip_trick_multi_turn``, but every turn is its own record, and
    each turn is sampled on a history that keeps only the newest reasoning (earlier assistant messages lose
    their ``...</think>`` part), as thinking models are served. The records share the request id; rewards
    see the whole trajectory as ``trajectory_inputs``. Train it with ``loss_scale = "last_round"`` as ms-swift."""

    async def run(self, infer_request: RolloutInferRequest, request_config: RequestConfig | None = None,
                  **kwargs: Any) -> list[dict[str, Any]]:
        engine = self.infer_engine
        request = infer_request
        results = []
        turn = 1
        while True:
            history = drop_old_thinking(request.messages)
            prompt_ids = engine.encode(engine.render(history))
            response = await engine.infer_async(request, request_config, prompt_token_ids=prompt_ids, **kwargs)
            choice = response.choices[0]
            request.messages.append({"role": "assistant", "content": choice.message.content})
            results.append({
                "messages": history + [{"role": "assistant", "content": choice.message.content}],
                "prompt_token_ids": prompt_ids,
                "response_token_ids": list(choice.token_ids or []),
                "rollout_logprobs": extract_logprobs(choice),
                "rollout_infos": {"num_turns": turn},
                "finish_reason": choice.finish_reason,
                "policy_versions": choice.policy_versions,
            })
            if self.check_finished(request, choice, turn) or (self.max_turns and turn >= self.max_turns):
                return results
            request = self.step(request, choice, turn)["infer_request"]
            turn += 1


def drop_old_thinking(messages: Messages) -> Messages:
    """Every assistant message keeps only what follows its ``</think>``."""
    out = copy.deepcopy(messages)
    for m in out:
        if m["role"] == "assistant" and isinstance(m["content"], str) and "</think>" in m["content"]:
            m["content"] = m["content"].split("</think>")[-1].strip()
    return out


# ---------------------------------------------------------------------------------- tool calls

CALCULATOR_TIMEOUT_S = 2.0
_REACT = re.compile(r"Action:\s*(.*?)\s*\nAction Input:\s*(.*?)(?:\n|$)", re.DOTALL)
_OBSERVATION = "\nObservation: "

# The calculator runs in its own interpreter (``python -I``), one expression per line on stdin: a hostile
# expression (9**9**9, deep nesting) can only burn that process, which the timeout kills and replaces.
_CALCULATOR_SOURCE = r"""
import ast, json, operator, sys
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.Pow: operator.pow, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}
def ev(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](ev(node.operand))
    raise ValueError("unsupported expression")
for line in sys.stdin:
    try:
        out = f"Result: {ev(ast.parse(json.loads(line).strip(), mode='eval').body)}"
    except Exception as exc:
        out = f"Calculation error: {exc}"
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
"""


class CalculatorPool:
    """Long-lived calculator processes, at most one per CPU core (bounded), started on first use. A call
    waits for a free process; only the calculation itself is under the timeout, not the wait or the start."""

    def __init__(self, size: int) -> None:
        self._idle: asyncio.Queue[asyncio.subprocess.Process | None] = asyncio.Queue()
        for _ in range(size):
            self._idle.put_nowait(None)  # a slot whose process is not started yet
        self.started = 0  # processes started so far (a timed-out one is replaced)

    async def run(self, expression: str, timeout_s: float) -> str:
        proc = await self._idle.get()
        try:
            if proc is None or proc.returncode is not None:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-I", "-c", _CALCULATOR_SOURCE,
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
                )
                self.started += 1
            assert proc.stdin is not None and proc.stdout is not None, "started with two pipes"
            proc.stdin.write((json.dumps(expression) + "\n").encode())
            await proc.stdin.drain()
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=timeout_s)
            if not line:
                raise ConnectionError("the calculator process exited")
            return json.loads(line)
        except TimeoutError:
            await _kill(proc)
            proc = None
            return f"Calculation error: timed out after {timeout_s:g} s"
        except (ConnectionError, ValueError) as exc:
            await _kill(proc)
            proc = None
            return f"Calculation error: {exc}"
        finally:
            self._idle.put_nowait(proc)


async def _kill(proc: asyncio.subprocess.Process | None) -> None:
    if proc is not None:
        with contextlib.suppress(ProcessLookupError):  # it may have exited just now
            proc.kill()
        await proc.wait()


_POOLS: dict[asyncio.AbstractEventLoop, CalculatorPool] = {}


def calculator_pool() -> CalculatorPool:
    """This event loop's pool (subprocess pipes belong to one loop; tests may run several)."""
    loop = asyncio.get_running_loop()
    if loop not in _POOLS:
        _POOLS.clear()
        _POOLS[loop] = CalculatorPool(os.cpu_count() or 1)
    return _POOLS[loop]


async def run_calculator(expression: str, timeout_s: float = CALCULATOR_TIMEOUT_S) -> str:
    """Evaluate an arithmetic expression in a calculator subprocess; a timeout kills it and says so."""
    return await calculator_pool().run(expression, timeout_s)


class ToolCallScheduler(MultiTurnScheduler):
    """``tool_call_scheduler``: ReAct tool calls in the assistant reply; the observation continues the reply."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_timeout_s = float(kwargs.get("tool_timeout_s", CALCULATOR_TIMEOUT_S))
        self.tools = {"calculator": self._calculator}

    async def _calculator(self, expression: str) -> str:
        return await run_calculator(expression, self.tool_timeout_s)

    @staticmethod
    def extract_tool_calls(text: str) -> list[dict[str, str]] | None:
        """ReAct calls written since the last observation (a pre-filled assistant message counts too)."""
        text = text.rsplit(_OBSERVATION, 1)[-1]
        calls = [{"tool": name.strip(), "params": params.strip()} for name, params in _REACT.findall(text)]
        return calls or None

    def check_finished(self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice,
                       current_turn: int) -> bool:
        if self.extract_tool_calls(infer_request.messages[-1]["content"]) is None:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    async def step(self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice,
                   current_turn: int) -> dict[str, Any]:
        calls = self.extract_tool_calls(infer_request.messages[-1]["content"])
        assert calls is not None, "check_finished ends the trajectory at a reply without a call"
        call = calls[0]  # one call per turn
        tool = self.tools.get(call["tool"])
        result = await tool(call["params"]) if tool else f"Error: unknown tool {call['tool']!r}"
        observation = f"{_OBSERVATION}{result}\n"
        ids = list(response_choice.token_ids or [])
        logprobs = extract_logprobs(response_choice)
        if ids and ids[-1] == self.tokenizer.eos_token_id:  # the reply goes on after the observation
            ids, logprobs = ids[:-1], logprobs[:-1]
        observed = self.tokenizer.encode(observation, add_special_tokens=False)
        infer_request.messages[-1]["content"] += observation
        return {
            "infer_request": infer_request,
            "response_token_ids": ids + observed,
            "response_loss_mask": [1] * len(ids) + [0] * len(observed),
            "rollout_logprobs": logprobs,
            "rollout_infos": {"tool_calls": [call], "tool_results": result, "num_turns": current_turn},
        }
