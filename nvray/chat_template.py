"""Chat prompts and the one way they become token ids: the model's chat template.

A chat prompt is a list of messages (dicts with string ``role`` and ``content``), or a
``ChatPrompt`` that also carries ``chat_template_kwargs`` (extra template variables, e.g.
Qwen3's ``{"enable_thinking": False}``) and ``add_generation_prompt``. Both forms travel as a
request's prompt (handles, the driver, HTTP); ``render_chat`` turns either into the token ids
the engine runs, so every caller (the EngineDriver, the offline ``LLM``, ``/tokenize``) gets
exactly the same tokens for the same conversation.

Bad input raises ``ChatTemplateError`` (a ValueError whose ``param`` names the request field):
a message without string role/content, a template variable that is really an argument of
``apply_chat_template`` (``tokenize``, ``chat_template``, ``messages``, ...:
``RESERVED_TEMPLATE_NAMES``), or a template that raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


class ChatTemplateError(ValueError):
    """A chat prompt the template cannot render; ``param`` is the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)  # args stay (message,) so the error pickles across Ray
        self.param = param


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation plus how to render it (the dataclass form of a chat prompt)."""

    messages: list[Message]
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # OpenAI's function tools, for the template


def is_chat(prompt: Any) -> bool:
    """Whether ``prompt`` is a chat prompt: a ChatPrompt, or a non-empty list of dicts."""
    if isinstance(prompt, ChatPrompt):
        return True
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def as_chat_prompt(prompt: ChatPrompt | list[Message]) -> ChatPrompt:
    return prompt if isinstance(prompt, ChatPrompt) else ChatPrompt(list(prompt))


# arguments of transformers' apply_chat_template (and the conversation itself), whichever
# tokenizer renders: not template variables
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


def check_chat_prompt(prompt: ChatPrompt) -> None:
    if not prompt.messages:
        raise ChatTemplateError("messages must not be empty", "messages")
    for i, m in enumerate(prompt.messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"messages[{i}] must have string 'role' and 'content'",
                                    "messages")
    if not isinstance(prompt.chat_template_kwargs, dict):
        raise ChatTemplateError("chat_template_kwargs must be an object", "chat_template_kwargs")
    reserved = sorted(set(prompt.chat_template_kwargs) & RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}: only "
                                "template variables (e.g. enable_thinking) are allowed",
                                "chat_template_kwargs")


def render_chat(tokenizer: Any, prompt: ChatPrompt | list[Message]) -> list[int]:
    """The token ids of a chat prompt: its template's text, encoded without extra special
    tokens (the template writes them)."""
    import jinja2  # noqa: PLC0415 - transformers' own dependency

    prompt = as_chat_prompt(prompt)
    check_chat_prompt(prompt)
    try:
        text = tokenizer.apply_chat_template(
            prompt.messages, tools=prompt.tools, tokenize=False,
            add_generation_prompt=prompt.add_generation_prompt, **prompt.chat_template_kwargs)
    except jinja2.TemplateError as e:  # e.g. the template's raise_exception(...)
        raise ChatTemplateError(f"the chat template rejected the messages: {e}",
                                "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
