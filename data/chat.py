"""Prompt rendering: the one place a policy prompt goes through the chat template.

Rollout, multi-turn schedulers (their re-rendering of a growing conversation), evaluation and the feeder's
prompt-length count all render through ``ChatTemplate``, so the learner, which trains on the rollout's token
ids, sees the same prompt the engine saw. What a user controls, as TRL and ms-swift name it:

- ``data.chat_template_kwargs`` (TRL's ``GRPOConfig.chat_template_kwargs``): extra keywords for every
  ``apply_chat_template`` call, e.g. ``{enable_thinking = false}`` for Qwen3;
- ``data.enable_thinking`` (ms-swift's ``--enable_thinking``): a shortcut for
  ``chat_template_kwargs["enable_thinking"]``;
- ``data.response_prefix`` (ms-swift's ``--response_prefix``): text that opens every generated reply;
- ``model.chat_template``: a jinja template (or a .jinja / chat_template.json file) used instead of the
  tokenizer's own (transformers' ``tokenizer.chat_template`` / ``apply_chat_template(chat_template=...)``);
- a dataset row's ``tools`` column (JSON-schema dicts, ms-swift's ``tools``): the template's ``tools``, so the
  model sees the tool schemas.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from pipeline.errors import UserError

TEMPLATE_FILE_SUFFIXES = (".jinja", ".j2", ".json")


class ChatTemplateError(UserError, ValueError):
    """A chat template, its keywords or a row's tools that cannot render a prompt."""


def template_kwargs(chat_template_kwargs: Mapping[str, Any], enable_thinking: bool | None) -> dict[str, Any]:
    """``chat_template_kwargs`` with ``enable_thinking`` (ms-swift's shortcut) added when set (the config
    refuses the two set to different values)."""
    kwargs = dict(chat_template_kwargs)
    if enable_thinking is not None:
        kwargs.setdefault("enable_thinking", enable_thinking)
    return kwargs


def looks_like_template(value: str) -> bool:
    """A jinja template string rather than a file name: it has a jinja tag."""
    return "{{" in value or "{%" in value


def load_template(value: str, *, where: str = "model.chat_template") -> str:
    """``value`` itself when it is a jinja template, else the template in the file it names: a .jinja file
    (transformers 5's chat_template.jinja) or a JSON file with a ``chat_template`` string (chat_template.json,
    tokenizer_config.json). A relative path is taken from the working directory."""
    if looks_like_template(value):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ChatTemplateError(
            f"{where}={value!r} is neither a jinja template (no {{{{ or {{% in it) nor a file; give the template "
            f"text or the path of a {' / '.join(TEMPLATE_FILE_SUFFIXES)} file"
        )
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"{where}={value!r}: cannot be read ({exc})") from None
    if path.suffix != ".json":
        return text
    try:
        template = json.loads(text).get("chat_template")
    except (ValueError, AttributeError):
        template = None
    if not isinstance(template, str):
        raise ChatTemplateError(
            f"{where}={value!r}: a .json template file must be an object with a \"chat_template\" string "
            f"(as transformers' chat_template.json)"
        )
    return template


def tool_schemas(tools: Any, *, where: str = "tools") -> list[dict[str, Any]] | None:
    """A row's ``tools`` as the template takes them: a list of JSON-schema dicts, or None for none. A JSON
    string (as ms-swift datasets often store the column) is decoded; an empty list is None (TRL: some
    templates render tool boilerplate for ``tools=[]``)."""
    if tools is None or (isinstance(tools, str) and not tools.strip()):  # an empty csv cell: none
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            raise ChatTemplateError(f"{where}: a string that is not JSON ({exc}); give a list of tool schemas") from None
    if isinstance(tools, Mapping):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise ChatTemplateError(
            f"{where}: must be a list of tool schemas (JSON objects such as {{\"type\": \"function\", "
            f"\"function\": {{\"name\": ..., \"parameters\": ...}}}}), got {type(tools).__name__}"
        )
    return [dict(t) for t in tools] or None


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """How a policy prompt is rendered: the template (None = the tokenizer's own), the extra template
    keywords and the reply prefix. Stateless: one instance serves every request and tokenizer."""

    template: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    response_prefix: str = ""

    @classmethod
    def from_config(cls, cfg: Any) -> ChatTemplate:
        """From ``model.chat_template``, ``data.chat_template_kwargs``, ``data.enable_thinking`` and
        ``data.response_prefix``; a template file is read here."""
        data = cfg.data
        template = cfg.model.chat_template
        return cls(
            template=load_template(template) if template is not None else None,
            kwargs=template_kwargs(data.chat_template_kwargs, data.enable_thinking),
            response_prefix=data.response_prefix or "",
        )

    def render(self, tokenizer: Any, messages: list[dict[str, Any]], *, tools: Any = None,
               close_last: bool = False) -> str:
        """The template's text for ``messages``: ending with the generation prompt (and the response prefix);
        a trailing assistant message is continued (a pre-filled reply) unless ``close_last`` closes it."""
        if self.template is None and not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"the tokenizer of {getattr(tokenizer, 'name_or_path', 'this model') or 'this model'} has no chat "
                f"template; set model.chat_template (a jinja template or a .jinja / .json file)"
            )
        continues = bool(messages) and messages[-1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(
            messages,
            tools=tool_schemas(tools),
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=not continues,
            continue_final_message=continues and not close_last,
            **self.kwargs,
        )
        if not continues:  # a new reply starts here
            text += self.response_prefix
        return text

    def token_ids(self, tokenizer: Any, messages: list[dict[str, Any]], *, tools: Any = None) -> list[int]:
        """The prompt as the engine sees it: ``render``'s text, tokenized without added special tokens."""
        return tokenizer.encode(self.render(tokenizer, messages, tools=tools), add_special_tokens=False)

    def check(self, tokenizer: Any) -> None:
        """Render a one-message conversation now, so a broken template or keyword fails at start, not on
        the first prompt."""
        try:
            self.render(tokenizer, [{"role": "user", "content": "hello"}])
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError) as exc:  # a jinja error or a template's raise_exception
            source = "model.chat_template" if self.template is not None else "the tokenizer's chat template"
            raise ChatTemplateError(
                f"{source} cannot render a prompt with data.chat_template_kwargs={dict(self.kwargs)!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from None


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], *, tools: Any = None,
                  chat_template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None) -> str:
    """``ChatTemplate(chat_template, chat_template_kwargs).render(tokenizer, messages, tools=tools)``."""
    return ChatTemplate(chat_template, dict(chat_template_kwargs or {})).render(tokenizer, messages, tools=tools)
