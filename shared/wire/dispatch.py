"""A service loop's table of what it handles: event type -> handler (after SGLang's TypeBasedDispatcher).

One dict lookup by exact type, in place of an isinstance chain: the events are final wire structs (never
subclassed), so the exact type is the event's kind.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping


class TypeDispatcher:
    def __init__(self, handlers: Mapping[type, Callable[[Any], Any]]):
        self._handlers = dict(handlers)

    def handles(self, obj) -> bool:
        return type(obj) in self._handlers

    def __call__(self, obj) -> Any:
        """Run obj's handler; TypeError when its type has none (ask handles() first when that may happen)."""
        handler = self._handlers.get(type(obj))
        if handler is None:
            raise TypeError(f"no handler for {type(obj).__name__}")
        return handler(obj)
