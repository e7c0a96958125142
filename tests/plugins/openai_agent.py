"""An agent program as people write one with the ``openai`` client (rollout.agent = "openai_agent:solve"):
its own loop, its own tool, its own reward. rollstream hands it a base URL and a key per episode."""

from __future__ import annotations

import json

import openai

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first number."},
                                                    "b": {"type": "integer", "description": "The second number."}},
                   "required": ["a", "b"]}}}


async def solve(base_url: str, api_key: str, row: dict) -> float:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["prompt"])
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = str(int(args["a"]) + int(args["b"]))
            except (ValueError, KeyError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    await client.close()
    answer = (messages[-1].get("content") or "").strip() if messages[-1]["role"] == "assistant" else ""
    return float(answer == row["solution"])


async def broken(base_url: str, api_key: str, row: dict) -> float:
    """A program with a bug: fails on every episode."""
    raise KeyError("answer")


async def dead_endpoint(base_url: str, api_key: str, row: dict) -> float:
    """A program pointed at an endpoint that is not there (a port nothing listens on)."""
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key=api_key, max_retries=0, timeout=5)
    await client.chat.completions.create(model="policy", messages=row["prompt"])
    return 1.0
