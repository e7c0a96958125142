# ruff: noqa: UP006, UP035 - typing.Dict/List as ms-swift's plugins write them
"""Multi-turn schedulers written the way ms-swift users write them (one per API form), for
tests/test_scheduler_compat.py. Each records what it was given in ``SEEN`` (this module is loaded once per
process by run.external_plugins; the test reads ``sys.modules["rollstream_plugin_sched_swift"].SEEN``).

- ``swift_tip_continuation``: ms-swift >= 3.8 continuation style (as v3.12's ``math_tip_trick``): the tip is
  written into the same assistant message after the reply's token_ids (which end with <|im_end|>), with
  ``self.tokenizer`` and ``self._extract_logprobs_from_choice``.
- ``swift_tool_new_turn``: ms-swift >= 3.8 new-turn style, constructor as ms-swift's GYMScheduler
  (``super().__init__(infer_engine, max_turns, **kwargs)`` positionally, ``tokenizer`` declared).
- ``swift_v37_style``: ms-swift 3.7 style: ``__init__(self, max_turns=None, *args, **kwargs)``, ``step``
  returns ``(infer_request, extra_dict)``.
- ``swift_rollout_output``: a ``run()`` override returning one ``RolloutOutput`` for two assistant turns.
- ``swift_always_fails``: raises in ``step`` on every request (the run must stop with its error).
"""

from typing import Any, Dict, List

from schedulers import MultiTurnScheduler, RolloutOutput, multi_turns

SEEN: Dict[str, List[Any]] = {}


def _see(key: str, value: Any) -> None:
    SEEN.setdefault(key, []).append(value)


class SwiftTipContinuation(MultiTurnScheduler):
    tips_prompt = " But wait... It seems I made a mistake,"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tips_ids = None
        _see("init", {"class": "SwiftTipContinuation", "max_turns": self.max_turns,
                      "engine": type(self.infer_engine).__name__, "kwargs": sorted(kwargs)})

    def check_finished(self, infer_request, response_choice, current_turn):
        if self.tips_prompt in infer_request.messages[-1]["content"]:
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn):
        completion = response_choice.message.content
        response_token_ids = list(response_choice.token_ids)
        rollout_logprobs = self._extract_logprobs_from_choice(response_choice)
        if self.tips_ids is None:
            self.tips_ids = self.tokenizer.encode(self.tips_prompt, add_special_tokens=False)
        infer_request.messages[-1]["content"] = completion + self.tips_prompt
        _see("step", {"ends_with_eos": response_token_ids[-1] == self.tokenizer.eos_token_id,
                      "logprobs": len(rollout_logprobs), "ids": len(response_token_ids)})
        return {
            "infer_request": infer_request,
            "response_token_ids": response_token_ids + self.tips_ids,
            "response_loss_mask": [1] * len(response_token_ids) + [0] * len(self.tips_ids),
            "rollout_logprobs": rollout_logprobs,
        }


class SwiftToolNewTurn(MultiTurnScheduler):
    def __init__(self, infer_engine=None, max_turns=None, tokenizer=None, **kwargs):
        super().__init__(infer_engine, max_turns, tokenizer=tokenizer, **kwargs)
        _see("init", {"class": "SwiftToolNewTurn", "max_turns": self.max_turns,
                      "engine": type(self.infer_engine).__name__, "tokenizer": tokenizer is not None})

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": f"Tool result {current_turn}: 12"})
        return {"infer_request": infer_request, "rollout_infos": {"tool_calls": current_turn}}


class SwiftV37Style(MultiTurnScheduler):
    def __init__(self, max_turns=None, *args, **kwargs):
        super().__init__(max_turns, *args, **kwargs)
        _see("init", {"class": "SwiftV37Style", "max_turns": self.max_turns, "kwargs": sorted(kwargs)})

    def step(self, infer_request, result, current_turn):
        infer_request.messages.append({"role": "user", "content": "Check it again."})
        return infer_request, {"checked_at": current_turn}


class SwiftRolloutOutput(MultiTurnScheduler):
    async def run(self, infer_request, request_config, **kwargs):
        messages = infer_request.messages
        token_ids, masks, logprobs = [], [], []
        for turn in (1, 2):
            response = await self.infer_engine.infer_async(infer_request, request_config, **kwargs)
            choice = response.choices[0]
            messages.append({"role": "assistant", "content": choice.message.content})
            token_ids.append(list(choice.token_ids))
            masks.append([1] * len(choice.token_ids))
            logprobs.append(self._extract_logprobs_from_choice(choice))
            if turn == 1:
                messages.append({"role": "user", "content": "Once more."})
        _see("run", {"request_id": infer_request.uuid, "response_id": response.id, "model": bool(response.model)})
        return RolloutOutput(response=response, messages=messages, response_token_ids=token_ids,
                             response_loss_mask=masks, rollout_logprobs=logprobs,
                             rollout_infos={"num_turns": 2, "via": "RolloutOutput"})


class SwiftAlwaysFails(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        raise AttributeError("'SwiftAlwaysFails' object has no attribute 'missing_helper'")

    def check_finished(self, infer_request, response_choice, current_turn):
        return False


multi_turns["swift_tip_continuation"] = SwiftTipContinuation
multi_turns["swift_tool_new_turn"] = SwiftToolNewTurn
multi_turns["swift_v37_style"] = SwiftV37Style
multi_turns["swift_rollout_output"] = SwiftRolloutOutput
multi_turns["swift_always_fails"] = SwiftAlwaysFails
