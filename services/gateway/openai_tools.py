"""A chat answer with tools, in OpenAI's shape: message.tool_calls, or streamed delta.tool_calls.

Forced calls (tool_choice "required" or a named function) are read as they stream (tool_calls.CallParser): the
first delta of each call carries its index, id, type and name with empty arguments, the next ones argument
fragments; finish_reason is "tool_calls" once the array is complete. A cut output (max_tokens) ends with
finish_reason "length": its last call's arguments are then not complete JSON, as with plain text.

With "auto" the model may answer in text or with the call array. A stream holds the text back only while it
could still be such an array (it starts with "["); once it cannot, the held text and the rest go out as content.
An output that is exactly an array of calls of the given tools becomes tool_calls (finish_reason "tool_calls"),
sent whole at the end; anything else is content.
"""

from __future__ import annotations

import logging

from services.gateway.structured_output import OutputPlan
from services.gateway.tool_calls import CallParser, parse_auto

logger = logging.getLogger(__name__)


def message(plan: OutputPlan, text: str, finish_reason: str) -> tuple[dict, str]:
    """The non-stream assistant message and finish reason of a chat answer under plan."""
    shaper = ToolShaper(plan)
    deltas = shaper.feed(text) + shaper.end(finish_reason)
    if not shaper.calls:
        return {"role": "assistant", "content": text}, finish_reason
    content = "".join(d.get("content") or "" for d in deltas) or None
    return ({"role": "assistant", "content": content, "tool_calls": [c.openai() for c in shaper.calls]},
            shaper.finish_reason(finish_reason))


class ToolShaper:
    """One answer's text deltas in, OpenAI delta dicts out ({"content": ...} or {"tool_calls": [...]})."""

    def __init__(self, plan: OutputPlan):
        self.plan = plan
        self.parser: CallParser | None = CallParser() if plan.tool_mode == "forced" else None
        self.held: str | None = "" if plan.tool_mode == "auto" else None  # auto: text held back, None once sent
        self.calls = []

    def feed(self, text: str) -> list[dict]:
        if self.parser is not None:
            try:
                deltas = self.parser.feed(text)
            except ValueError:  # the grammar should make this impossible: send the text rather than lose it
                logger.exception("unreadable constrained tool calls; sending them as text")
                self.parser = None
                return [{"content": text}]
            self.calls = self.parser.calls
            return [{"tool_calls": deltas}] if deltas else []
        if self.held is not None:
            self.held += text
            if self.held.lstrip() == "" or self.held.lstrip().startswith("["):
                return []
            text, self.held = self.held, None
        return [{"content": text}] if text else []

    def end(self, finish_reason: str) -> list[dict]:
        """The deltas still to send once the output is complete."""
        if self.held is None:
            return []
        held, self.held = self.held, None
        calls = parse_auto(held, list(self.plan.tools)) if finish_reason == "stop" else None
        if calls is None:
            return [{"content": held}] if held else []
        self.calls = calls
        return [{"tool_calls": [{"index": i, **c.openai()} for i, c in enumerate(calls)]}]

    def finish_reason(self, native: str) -> str:
        if not self.calls or native != "stop":
            return native
        return "tool_calls" if self.parser is None or self.parser.complete else native
