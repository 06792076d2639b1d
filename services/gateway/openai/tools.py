"""A chat answer with tools, in OpenAI's shape: message.tool_calls, or streamed delta.tool_calls.

Calls are read as they stream (tool_calls.CallParser): the first delta of each call carries its index, id, type
and name with empty arguments, the next ones argument fragments; finish_reason is "tool_calls" once the array is
complete. A cut output (max_tokens) ends with finish_reason "length": its last call's arguments are then not
complete JSON, as with plain text.

With tool_choice "required" or a named function the whole output is the call array. With "auto" the grammar
(tool_calls.auto_grammar) lets the model either write text that does not start with "[" or the call array, so the
first character decides: "[" and the answer is tool calls, anything else and it is content.
"""

from __future__ import annotations

import logging

from typing import TYPE_CHECKING

from services.gateway.openai.tool_calls import Call, CallParser

if TYPE_CHECKING:
    from services.gateway.openai.structured_output import OutputPlan

logger = logging.getLogger(__name__)


def message(plan: OutputPlan, text: str, finish_reason: str) -> tuple[dict, str]:
    """The non-stream assistant message and finish reason of a chat answer under plan."""
    shaper = ToolShaper(plan)
    deltas = shaper.feed(text)
    if not shaper.calls:
        return {"role": "assistant", "content": text}, finish_reason
    content = "".join(d.get("content") or "" for d in deltas) or None
    return (
        {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in shaper.calls]},
        shaper.finish_reason(finish_reason),
    )


class ToolShaper:
    """One answer's text deltas in, OpenAI delta dicts out ({"content": ...} or {"tool_calls": [...]})."""

    def __init__(self, plan: OutputPlan):
        self.parser: CallParser | None = CallParser() if plan.tool_mode == "forced" else None
        self.deciding = plan.tool_mode == "auto"  # auto: the first character says calls ("[") or content
        self.calls: list[Call] = []

    def feed(self, text: str) -> list[dict]:
        if self.deciding and text:
            self.deciding = False
            if text.startswith("["):
                self.parser = CallParser()
        if self.parser is not None:
            try:
                deltas = self.parser.feed(text)
            except ValueError:  # the grammar should make this impossible: send the text rather than lose it
                logger.exception("unreadable constrained tool calls; sending them as text")
                self.parser = None
                return [{"content": text}]
            self.calls = self.parser.calls
            return [{"tool_calls": deltas}] if deltas else []
        return [{"content": text}] if text else []

    def finish_reason(self, native: str) -> str:
        """ "tool_calls" when the output ended on its own (EOS) with the call array complete."""
        complete = self.parser is not None and self.parser.complete
        return "tool_calls" if complete and native == "stop" else native
