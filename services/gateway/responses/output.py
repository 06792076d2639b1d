"""A response's output items and its events, made from the generated text as it arrives (OutputBuilder), and the
Response object around them (Envelope).

The non-stream answer is the stream's builder fed the whole text at once, its events dropped: the output a client
reads streamed is the one stored and returned whole, down to the call ids. Text and tool calls are cut exactly as
chat completions cuts them (openai.tools.ToolShaper): with tools, an answer is either text or the call array.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.gateway.openai.tools import ToolShaper
from services.gateway.responses.items import new_id

if TYPE_CHECKING:
    from services.gateway.openai.structured_output import OutputPlan

# Fields of the request echoed in the Response object, as OpenAI's does (the SDK's Response model has them).
ECHOED = (
    "instructions",
    "max_output_tokens",
    "metadata",
    "parallel_tool_calls",
    "previous_response_id",
    "store",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_p",
    "truncation",
    "user",
)


def usage(native: dict) -> dict:
    """A native body's usage in the Responses API's names."""
    return {
        "input_tokens": native["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": native.get("cached_tokens", 0)},
        "output_tokens": native["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},  # the served models write no separate reasoning
        "total_tokens": native["total_tokens"],
    }


@dataclass
class Envelope:
    """What every Response object of one request shares: its id, time, model and the echoed request fields."""

    id: str
    model: str
    echoed: dict
    background: bool = False
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self, status: str, output: list[dict], native_usage: dict | None = None, incomplete: str | None = None
    ) -> dict:
        """The Response object; native_usage: the native body's usage (None while it runs)."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": self.background,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model,
            "output": output,
            "usage": usage(native_usage) if native_usage is not None else None,
            **self.echoed,
        }


class OutputBuilder:
    """Text in (feed, then finish once), output items and the Responses stream events out (without their
    sequence_number: the stream numbers them)."""

    def __init__(self, plan: OutputPlan):
        self.shaper = ToolShaper(plan) if plan.tool_mode != "none" else None
        self.output: list[dict] = []
        self._message: dict | None = None  # the open message item (text goes there)
        self._calls: dict[int, int] = {}  # a call's index among the calls -> its item's output index

    def feed(self, text: str) -> list[dict]:
        deltas = self.shaper.feed(text) if self.shaper is not None else ([{"content": text}] if text else [])
        events: list[dict] = []
        for d in deltas:
            if d.get("content"):
                events += self._text(d["content"])
            for call in d.get("tool_calls") or []:
                events += self._call(call)
        return events

    def finish(self, finish_reason: str) -> tuple[str, str | None, list[dict]]:
        """(status, incomplete reason, the closing events): every open item done, completed or cut."""
        cut = finish_reason == "length"
        events = [] if self.output else self._open_message()  # an empty answer is an empty message, as OpenAI's
        for index, item in enumerate(self.output):
            item["status"] = "incomplete" if cut else "completed"
            where = {"item_id": item["id"], "output_index": index}
            if item["type"] == "message":
                part = item["content"][0]
                events += [
                    {"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"]},
                    {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)},
                ]
            else:
                args = {"arguments": item["arguments"], "name": item["name"]}
                events.append({"type": "response.function_call_arguments.done", **where, **args})
            events.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})
        return ("incomplete", "max_output_tokens", events) if cut else ("completed", None, events)

    def adopt_ids(self, ids: list[tuple[str, str | None]]) -> None:
        """Give the first items these (id, call_id): a takeover's builder, fed the text another gateway's had been,
        continues the items that gateway's stream announced (responses.takeover)."""
        for item, (item_id, call_id) in zip(self.output, ids):
            item["id"] = item_id
            if call_id is not None:
                item["call_id"] = call_id

    def _added(self, item: dict) -> dict:
        self.output.append(item)
        return {"type": "response.output_item.added", "output_index": len(self.output) - 1, "item": _copy(item)}

    def _open_message(self) -> list[dict]:
        item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        added = self._added(item)
        part = {"type": "output_text", "text": "", "annotations": []}
        item["content"].append(part)
        self._message = item
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        return [added, {"type": "response.content_part.added", **where, "part": dict(part)}]

    def _text(self, text: str) -> list[dict]:
        events = self._open_message() if self._message is None else []
        self._message["content"][0]["text"] += text
        where = {"item_id": self._message["id"], "output_index": self.output.index(self._message)}
        return [*events, {"type": "response.output_text.delta", **where, "content_index": 0, "delta": text}]

    def _call(self, delta: dict) -> list[dict]:
        events = []
        if "id" in delta:  # a call's first delta: its id and name
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": delta["id"],
                "name": delta["function"]["name"],
                "arguments": "",
            }
            events.append(self._added(item))
            self._calls[delta["index"]] = len(self.output) - 1
        index = self._calls[delta["index"]]
        piece = delta["function"].get("arguments") or ""
        if piece:
            item = self.output[index]
            item["arguments"] += piece
            events.append(
                {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index}
                | {"delta": piece}
            )
        return events


def _copy(item: dict) -> dict:
    """The item as it is now (an event's snapshot: the builder goes on changing the item itself)."""
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)
