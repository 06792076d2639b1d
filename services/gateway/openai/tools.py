"""A chat answer with tools, in OpenAI's shape: message.tool_calls, or streamed delta.tool_calls.

Calls are read as they stream (tool_calls.CallParser): the first delta of each call carries its index, id, type
and name with empty arguments, the next ones argument fragments; finish_reason is "tool_calls" once the array is
complete. A cut output (max_tokens) ends with finish_reason "length", streamed or not alike: the calls whose name
was complete, the last one's arguments then not complete JSON (as vLLM answers a cut named call: its name and the
partial arguments), and no content, also when the cut came before any name (the call array's raw text is never
content; vLLM's "required" path fails to parse it instead, and OpenAI's cut calls carry their partial arguments).

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
    """The non-stream assistant message and finish reason of a chat answer under plan: what the stream's deltas of
    the same text add up to (ToolShaper reads both)."""
    shaper = ToolShaper(plan)
    deltas = shaper.feed(text)
    if not shaper.calls:
        # A call array cut (max_tokens) before its first name is complete ('[', '[{"name": "get_cur') has no call
        # yet, and its text is no answer either: content null, as the stream sends no text for it.
        return {"role": "assistant", "content": None if shaper.parser is not None else text}, finish_reason
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
