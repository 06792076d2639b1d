"""Base exceptions of the shared package.

Recoverable errors (a retry or a redelivery can succeed) are kept apart from fatal ones
(the process cannot go on and should exit so its supervisor restarts it).
"""


class ConveyorError(Exception):
    """Base of every error raised by shared/."""


class RecoverableError(ConveyorError):
    """A failure that a retry may fix (Redis briefly away, a timeout)."""


class FatalError(ConveyorError):
    """A failure that the process cannot recover from (bad configuration, missing model)."""


class ModelLoadError(FatalError):
    """The configured model cannot be found or loaded."""
