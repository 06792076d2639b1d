"""Errors raised by the engine, split like shared.wire.errors into recoverable and fatal.

Errors that concern a single request never escape `LLMEngine.step()`: that request is
failed alone and reported through `RequestOutput.error_reason` (one of the reasons below).
"""

from __future__ import annotations

from shared.wire.errors import ConveyorError, FatalError, RecoverableError
from shared.wire.events import Reason

# `RequestOutput.error_reason` values: the contract's, sent on as the Failed event's reason.
TOO_LONG = Reason.TOO_LONG  # the request can never fit the KV pool / context window
OOM = Reason.OOM  # device out of memory even when the request ran alone
WORKER_ERROR = Reason.WORKER_ERROR  # any other exception while processing this request


class EngineError(ConveyorError):
    """Base of every error raised by the engine."""


class RecoverableEngineError(EngineError, RecoverableError):
    """The engine is healthy; only the call that raised was refused."""


class FatalEngineError(EngineError, FatalError):
    """The engine cannot serve (model or KV pool unusable); the process should restart."""


class InvalidRequestError(RecoverableEngineError):
    """add_request() was given a malformed request (bad sampling values, duplicate id, empty prompt)."""


class EngineLoadError(FatalEngineError):
    """The model folder cannot be loaded or the KV pool cannot be sized on this device."""


class BlockPoolExhausted(FatalEngineError):
    """Internal invariant broken: an allocation was attempted without checking free blocks first."""
