"""Chat-template control (TRL's chat_template_kwargs, ms-swift's enable_thinking / response_prefix, a template
override) and a row's tools column, from the config and the dataset to the prompt the real engine samples from:
rollout, multi-turn re-rendering and evaluation alike."""

from __future__ import annotations

import json

import msgspec
import pytest
from fake_context import FakeContext
from transformers import AutoTokenizer

from config import ConfigError, config_from_dict
from data.chat import ChatTemplate, ChatTemplateError, load_template, tool_schemas
from engines.sampler import reward_columns, task_tools
from pipeline.records import PromptTask, TrajectoryGroup, decode, encode
from rollstream.train import build_stage
from schedulers import MultiTurnScheduler, multi_turns
from schedulers.engine import InferEngine, RequestContext, request_context
from stages.feeder import Feeder

# Qwen3's template in miniature: the tool names in a system turn, and an empty think block opening the reply
# when enable_thinking is false (Qwen3 writes "<think>\n\n</think>\n\n" there).
QWEN3_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for tool in tools %}"
    "{{- tool.function.name + '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
EMPTY_THINK = "<think>\n\n</think>\n\n"
TOOLS = [
    {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "web_search", "parameters": {"type": "object", "properties": {}}}},
]
QUESTION = [{"role": "user", "content": "What is 3+4?"}]


def config(rollout=None, **data):
    return config_from_dict({
        "model": {"chat_template": QWEN3_STYLE},
        "data": {"enable_thinking": False, **data},
        "grpo": {"max_completion_length": 8, "num_generations": 2, "per_device_train_batch_size": 2},
        "rollout": {"max_concurrent_groups": 4, **(rollout or {})},
        "reward": {"reward_funcs": ["accuracy"]},
        "eval": {"per_device_eval_batch_size": 2},
    })


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def tool_task(tools=TOOLS, **fields):
    return PromptTask(prompt_id="e0:1", generation_batch=0, num_generations=2, messages=QUESTION,
                      data_dict={"solution": "7"}, seed=11, tools=tools, **fields)


# ------------------------------------------------------------------------------------------- rendering


def test_enable_thinking_false_opens_the_reply_with_an_empty_think_block(tokenizer):
    off = ChatTemplate.from_config(config()).render(tokenizer, QUESTION)
    assert off.endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    on = ChatTemplate.from_config(config(enable_thinking=True)).render(tokenizer, QUESTION)
    unset = ChatTemplate.from_config(config(enable_thinking=None)).render(tokenizer, QUESTION)
    assert on == unset == off.removesuffix(EMPTY_THINK)
    # TRL's spelling says the same
    trl = ChatTemplate.from_config(config(enable_thinking=None, chat_template_kwargs={"enable_thinking": False}))
    assert trl.render(tokenizer, QUESTION) == off


def test_tools_reach_the_template_and_a_json_string_column_is_decoded(tokenizer):
    chat = ChatTemplate.from_config(config())
    text = chat.render(tokenizer, QUESTION, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\ncalculator\nweb_search\n<|im_end|>\n")
    assert chat.render(tokenizer, QUESTION, tools=json.dumps(TOOLS)) == text  # ms-swift datasets store JSON text
    assert chat.render(tokenizer, QUESTION, tools=[]) == chat.render(tokenizer, QUESTION)  # [] = none (TRL)
    with pytest.raises(ChatTemplateError, match="tools.*list of tool schemas"):
        tool_schemas([1, 2])
    with pytest.raises(ChatTemplateError, match="not JSON"):
        tool_schemas("[{")


def test_response_prefix_opens_every_new_reply_but_not_a_continued_one(tokenizer):
    chat = ChatTemplate.from_config(config(enable_thinking=None, response_prefix="Answer:"))
    assert chat.render(tokenizer, QUESTION).endswith("<|im_start|>assistant\nAnswer:")
    continued = [*QUESTION, {"role": "assistant", "content": "It is"}]
    assert chat.render(tokenizer, continued).endswith("It is")


def test_the_template_override_reads_text_a_jinja_file_and_a_chat_template_json(tmp_path, tokenizer):
    (tmp_path / "t.jinja").write_text(QWEN3_STYLE)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": QWEN3_STYLE}))
    assert load_template(QWEN3_STYLE) == load_template(str(tmp_path / "t.jinja")) == QWEN3_STYLE
    assert load_template(str(tmp_path / "chat_template.json")) == QWEN3_STYLE
    with pytest.raises(ChatTemplateError, match=r"model.chat_template='nope.jinja' is neither a jinja template"):
        load_template("nope.jinja")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="chat_template"):
        load_template(str(tmp_path / "bad.json"))
    # without the override the tokenizer's own template renders (no think block: it knows no enable_thinking)
    plain = ChatTemplate.from_config(config_from_dict({"data": {"enable_thinking": False},
                                                       "reward": {"reward_funcs": ["accuracy"]}}))
    assert plain.render(tokenizer, QUESTION) == tokenizer.apply_chat_template(QUESTION, tokenize=False,
                                                                             add_generation_prompt=True)


def test_a_broken_template_fails_at_start_naming_the_field(tokenizer):
    with pytest.raises(ChatTemplateError, match="model.chat_template cannot render a prompt"):
        ChatTemplate("{{ raise_exception('no') }}").check(tokenizer)
    with pytest.raises(ChatTemplateError, match="model.chat_template cannot render"):
        ChatTemplate("{% for %}").check(tokenizer)


def test_config_refuses_a_disagreement_and_apply_chat_templates_own_arguments():
    with pytest.raises(ConfigError, match=r"data.enable_thinking=false but data.chat_template_kwargs.enable_thinking"
                                          r"=true; they disagree"):
        config(chat_template_kwargs={"enable_thinking": True})
    config(chat_template_kwargs={"enable_thinking": False})  # agreeing is fine
    with pytest.raises(ConfigError, match="chat_template_kwargs holds add_generation_prompt, tools"):
        config(chat_template_kwargs={"tools": [], "add_generation_prompt": False})


def test_scheduler_rendering_uses_the_run_template_and_the_requests_tools(tokenizer):
    class Holder:  # render needs only a tokenizer
        pass

    holder = Holder()
    holder.tokenizer = tokenizer
    engine = InferEngine(holder, max_model_len=256, chat=ChatTemplate.from_config(config()))
    history = [*QUESTION, {"role": "assistant", "content": "8"}, {"role": "user", "content": "Again."}]
    with request_context(RequestContext(request_id="r", config=None, tools=TOOLS)):
        text = engine.render(history)
    assert "calculator\nweb_search" in text and text.endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert "web_search" not in engine.render(history)  # outside the request: no tools


# ------------------------------------------------------------------------------------ records and feeder


def test_old_prompt_task_bytes_decode_and_their_tools_are_still_found():
    old = msgspec.msgpack.encode({"type": "prompt_task", "schema": 1, "prompt_id": "e0:1", "generation_batch": 0,
                                  "num_generations": 2, "messages": QUESTION,
                                  "data_dict": {"solution": "7", "tools": TOOLS}})
    task = decode(old)
    assert isinstance(task, PromptTask) and task.tools is None
    assert task_tools(task) == TOOLS and reward_columns(task)["tools"] == TOOLS
    new = decode(encode(tool_task()))
    assert new.tools == TOOLS and task_tools(new) == TOOLS and "tools" not in new.data_dict
    assert reward_columns(new) == {"solution": "7", "tools": TOOLS}  # the reward functions still get the column


def test_the_feeder_carries_tools_and_counts_prompts_as_the_rollout_renders_them(tokenizer, tiny_model_dir):
    rows = [{"messages": QUESTION, "solution": "7", "tools": TOOLS if i % 2 else None} for i in range(8)]
    feeder = Feeder(config(), rows)
    tasks = feeder.release_batch()
    assert {t.prompt_id: t.tools for t in tasks} == {
        t.prompt_id: (TOOLS if int(t.prompt_id.split(":")[1]) % 2 else None) for t in tasks}
    assert all("tools" not in t.data_dict for t in tasks)
    # truncation_strategy = "delete": a prompt's length includes the tool schemas and the think block
    chat = ChatTemplate.from_config(config())
    plain = len(chat.token_ids(tokenizer, QUESTION))
    with_tools = len(chat.token_ids(tokenizer, QUESTION, tools=TOOLS))
    assert with_tools > plain > len(ChatTemplate().token_ids(tokenizer, QUESTION))
    cfg = config(max_length=plain)
    cfg.grpo.truncation_strategy = "delete"
    feeder = Feeder(cfg, rows, tokenizer=tokenizer)
    assert all(t.tools is None for t in feeder.release_batch()) and feeder.skipped_too_long > 0
    # as the pipeline builds it (the model's tokenizer)
    built = build_stage("feeder", cfg, model_dir=tiny_model_dir, rows=rows)
    assert all(t.tools is None for t in built.release_batch()) and built.skipped_too_long > 0


# ------------------------------------------------------------------- the real engine: rollout and evaluation


def decoded_prompt(tokenizer, trajectory):
    return tokenizer.decode(list(trajectory.prompt_token_ids()), skip_special_tokens=False)


@pytest.mark.e2e
async def test_the_engine_samples_from_the_rendered_prompt_with_tools_and_no_thinking(vllm_engine, tiny_model_dir):
    from stages.rollout import Rollout

    await vllm_engine.reset_weights(tiny_model_dir)
    stage = Rollout(config(), tiny_model_dir, engine=vllm_engine)
    await stage.start(FakeContext(run='chat', stage='rollout'))
    [(_, group)] = (await stage.handle(tool_task(), FakeContext(run='chat', stage='rollout'))).outputs
    assert isinstance(group, TrajectoryGroup) and len(group.trajectories) == 2
    for t in group.trajectories:
        prompt = decoded_prompt(vllm_engine.tokenizer, t)
        assert prompt.startswith("<|im_start|>system\n# Tools\ncalculator\nweb_search\n")
        assert prompt.endswith("What is 3+4?<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK)
        assert t.data_dict == {"solution": "7", "tools": TOOLS} and len(t.completion_token_ids()) > 0
    # a template that cannot render stops the rollout at start, naming the field
    broken = config()
    broken.model.chat_template = "{{ raise_exception('this template needs a system message') }}"
    with pytest.raises(ChatTemplateError, match="model.chat_template cannot render a prompt.*needs a system message"):
        await Rollout(broken, tiny_model_dir, engine=vllm_engine).start(FakeContext(run='chat', stage='rollout'))


class AgainScheduler(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "Again."})
        return {"infer_request": infer_request}


@pytest.mark.e2e
async def test_every_turn_of_a_multi_turn_request_is_rendered_with_the_template(vllm_engine, tiny_model_dir):
    from stages.rollout import Rollout

    await vllm_engine.reset_weights(tiny_model_dir)
    multi_turns["chat_again"] = AgainScheduler
    try:
        stage = Rollout(config({"multi_turn_scheduler": "chat_again", "max_turns": 3}), tiny_model_dir,
                        engine=vllm_engine)
        await stage.start(FakeContext(run='chat', stage='rollout'))
        [(_, group)] = (await stage.handle(tool_task(), FakeContext(run='chat', stage='rollout'))).outputs
    finally:
        multi_turns.pop("chat_again", None)
    for t in group.trajectories:
        assert t.rollout_infos["num_turns"] == 3
        prompt = decoded_prompt(vllm_engine.tokenizer, t)
        whole = prompt + vllm_engine.tokenizer.decode(list(t.completion_token_ids()), skip_special_tokens=False)
        assert prompt.startswith("<|im_start|>system\n# Tools\ncalculator\n") and prompt.endswith(EMPTY_THINK)
        # the later turns' generation prompts, re-rendered after each "Again.", open with the think block too
        assert whole.count("Again.<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK) == 2


@pytest.mark.e2e
async def test_evaluation_renders_held_out_prompts_with_the_template_and_tools(vllm_engine, tiny_model_dir):
    from rewards.scoring import RewardScorer
    from stages.evaluate import evaluate_version

    await vllm_engine.reset_weights(tiny_model_dir)
    cfg = config()
    scorer = RewardScorer(cfg)
    await scorer.start(("chat", "evaluate", "w0"))
    rows = [{"messages": QUESTION, "solution": "7", "tools": TOOLS}, {"messages": QUESTION, "solution": "7"}]
    try:
        groups = await evaluate_version(vllm_engine, scorer, cfg, rows, 0)
    finally:
        await scorer.close()
    with_tools, without = (decoded_prompt(vllm_engine.tokenizer, g[0].trajectory) for g in groups)
    assert with_tools.startswith("<|im_start|>system\n# Tools\ncalculator\n") and with_tools.endswith(EMPTY_THINK)
    assert without.startswith("<|im_start|>user\nWhat is 3+4?") and without.endswith(EMPTY_THINK)


def test_the_final_model_keeps_the_template_the_run_rendered_with(tiny_model_dir, tmp_path):
    """``final/`` from a run with model.chat_template: transformers loads it with that template, so the trained
    model is prompted as it was trained."""
    from trainer.trainer import Trainer

    cfg = config()
    trainer = Trainer(cfg, tiny_model_dir, tmp_path / "out", num_batches=1)
    trainer.load()
    trainer.save_final()
    final = AutoTokenizer.from_pretrained(str(tmp_path / "out" / "final"))
    assert final.chat_template == QWEN3_STYLE
