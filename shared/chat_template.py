"""A chat request's prompt text: the model's chat template, and the tools of a request put into it.

Used by the tokenizer service (every chat request) and the gateway's /tokenize (the same text a request would get).

A chat template that takes `tools` (it mentions them) renders them its own way. One that does not (SmolLM2's)
gets them from here, in a system turn: the functions' definitions and the one call format the gateway reads back
(services/gateway/openai/tool_calls.py): a JSON array of {"name", "arguments"} and nothing else. The grammar holds the
model to that format whatever the prompt says (with "auto", to it or text); the prompt is what makes a call
likely when one is not forced.
"""

from __future__ import annotations

import json

import jinja2


class TemplateRefused(ValueError):
    """The model's own chat template refuses this conversation (its raise_exception)."""


CALL_FORMAT = (
    "To call one or more of these functions, reply with only a JSON array of calls, "
    '[{"name": "<function name>", "arguments": {<its arguments>}}], and nothing else. '
    "To answer without calling a function, reply with plain text."
)


def tools_prompt(tools: list[dict]) -> str:
    lines = [json.dumps(t.get("function", t), ensure_ascii=False) for t in tools]
    return (
        "You can call these functions (each with a JSON Schema of its arguments):\n"
        + "\n".join(lines)
        + "\n\n"
        + CALL_FORMAT
    )


def template_takes_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in (template if isinstance(template, str) else json.dumps(template))


def with_tools(chat: list[dict], tools: list[dict]) -> list[dict]:
    """chat with the tools described in its system turn (added first when it has none)."""
    prompt = tools_prompt(tools)
    if chat and chat[0]["role"] == "system":
        return [{"role": "system", "content": f"{chat[0]['content']}\n\n{prompt}"}, *chat[1:]]
    return [{"role": "system", "content": prompt}, *chat]


def render(tokenizer, chat: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation (with its tools), as the model's template writes it. Raises TemplateRefused
    when the template refuses it (Mistral's and Llama 2's on two user turns in a row, Gemma's on a system turn)."""
    try:
        if tools and template_takes_tools(tokenizer):
            return tokenizer.apply_chat_template(
                chat, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        if tools:
            chat = with_tools(chat, tools)
        return tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
    except jinja2.TemplateError as e:
        raise TemplateRefused(f"the model's chat template refuses them: {e}") from e
