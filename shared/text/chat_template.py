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


# apply_chat_template's own parameters and the names it gives the template: a chat_template_kwargs key among them
# would change what render does (tokenize, another template) or break the template rather than be a variable of it.
RESERVED_KWARGS = frozenset(
    {
        "messages",
        "raise_exception",
        "strftime_now",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
MAX_KWARGS_CHARS = 65_536  # chat_template_kwargs as JSON text (it travels on every request event)


def kwargs_problem(kwargs: dict) -> tuple[str, str] | None:
    """(the key at fault or "", why) if chat_template_kwargs cannot be passed to the template, else None."""
    for key in kwargs:
        if key in RESERVED_KWARGS:
            return key, "is a parameter of the template call, not a template variable (use the request's own field)"
    size = len(json.dumps(kwargs))
    if size > MAX_KWARGS_CHARS:
        return "", f"is {size} characters as JSON; at most {MAX_KWARGS_CHARS}"
    return None


def render(
    tokenizer,
    chat: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> str:
    """The prompt text of a conversation (with its tools), as the model's template writes it: with the assistant
    turn's opening (add_generation_prompt), or ending inside the last message, to be continued
    (continue_final_message); template_kwargs are the template's variables (checked by kwargs_problem). Raises
    TemplateRefused when the template refuses it (Mistral's and Llama 2's on two user turns in a row, Gemma's on a
    system turn)."""
    options = {
        **(template_kwargs or {}),
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "tokenize": False,
    }
    try:
        if tools and template_takes_tools(tokenizer):
            return tokenizer.apply_chat_template(chat, tools=tools, **options)
        if tools:
            chat = with_tools(chat, tools)
        return tokenizer.apply_chat_template(chat, **options)
    except jinja2.TemplateError as e:
        raise TemplateRefused(f"the model's chat template refuses them: {e}") from e
    except (ValueError, TypeError) as e:  # the last message not written as given (continue_final_message), or a
        # template variable of chat_template_kwargs the template cannot use
        raise TemplateRefused(f"the model's chat template cannot render them: {e}") from e
