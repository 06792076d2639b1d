"""What an OpenAI answer tells of its prompts, read from the requests' input layers (the tokenizer wrote each
prompt's token ids there before any output of it): vLLM's stream_options.continuous_usage_stats (the usage so far on
every chunk) and return_token_ids (each choice's prompt_token_ids). Read once per prompt, only when asked for."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec
import redis

if TYPE_CHECKING:
    from services.gateway.openai.stream import Shape
    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import Choices

logger = logging.getLogger(__name__)


class PromptFacts:
    def __init__(self, core: GatewayCore, choices: Choices, wanted: bool = True):
        """wanted: the request asked for continuous usage or token ids (else learn and stamp do nothing)."""
        self.core, self.handles, self.wanted = core, choices.handles, wanted
        self.per = choices.per_prompt or len(self.handles)  # choices per prompt: choice i is prompt i // per's
        self.prompts: dict[int, list[int]] = {}
        self.sent: set[int] = set()  # the choices whose prompt ids went out (a stream's)

    async def learn(self, index: int) -> None:
        """Read choice index's prompt ids, unless its prompt's are known (call once it has output)."""
        group = index // self.per
        if not self.wanted or group in self.prompts:
            return
        rid = self.handles[index].request_id
        try:
            raw = await self.core.r.hget(self.core.names.layer(rid, "input"), "prompt_token_ids")
        except redis.RedisError as e:  # the answer goes on without them: its prompt counts as empty
            logger.warning("request %s: its prompt's token ids could not be read (%r)", rid, e)
            raw = None
        self.prompts[group] = msgspec.json.decode(raw) if raw else []

    def ids(self, index: int) -> list[int]:
        return self.prompts.get(index // self.per, [])

    def stamp(self, outs: list[dict], index: int, completion: int, shape: Shape, first: bool = False) -> None:
        """Put on a choice's stream chunks what the request asked for: the usage so far, and its prompt's ids on
        its first chunk (chat: the response's, on its role chunk)."""
        if not self.wanted:
            return
        prompt = len(self.ids(index))
        for out in outs:
            if shape.continuous_usage:
                out["usage"] = {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                }
        if shape.return_token_ids and outs and (first or not shape.chat) and index not in self.sent:
            self.sent.add(index)
            where = outs[0] if shape.chat else outs[0]["choices"][0]
            where["prompt_token_ids"] = self.ids(index)


async def prompt_ids(core: GatewayCore, choices: Choices) -> list[list[int]]:
    """Every choice's prompt token ids (a finished request's: each prompt read once)."""
    facts = PromptFacts(core, choices)
    for i in range(len(choices.handles)):
        await facts.learn(i)
    return [facts.ids(i) for i in range(len(choices.handles))]
