"""The one error hierarchy of mlx-trio.

Every error a user can see derives from `MlxTrioError`. Each type refines the
builtin it resembles (attrs' convention), so `except ValueError` still works for
callers that do not know our names, and each says when it is raised. The HTTP
layer maps them to status codes in exactly one place (`mlx_trio/http/server/errors.py`).
"""

from __future__ import annotations

from collections.abc import Iterator


class MlxTrioError(Exception):
    """Base of every error raised on purpose by mlx-trio.

    Picklable whatever a subclass's `__init__` takes (pickle's default calls
    `cls(*args)`, which fails for `InvalidParameter(field, message)`): the engine
    link (mlx_trio/link/) carries them between processes.
    """

    def __reduce__(self) -> tuple[object, ...]:
        return _rebuilt, (type(self), self.args, dict(self.__dict__))


def _rebuilt(cls: type[MlxTrioError], args: tuple[object, ...], state: dict[str, object]) -> MlxTrioError:
    """An `MlxTrioError` of `cls` with `args` and attributes `state`, without calling its `__init__`."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class RequestError(MlxTrioError, ValueError):
    """The request itself is wrong; resending it unchanged fails again (HTTP 4xx)."""

    status_code = 400


class InvalidParameter(RequestError):
    """A request field has a wrong type or an out-of-range value.

    `field` names the offending field exactly as the caller spelled it, so an
    HTTP client can be told which key to change.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ContextTooLong(RequestError):
    """The prompt plus the requested completion exceed the model's context."""

    def __init__(self, message: str, field: str = "messages") -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class ModelNotFound(RequestError):
    """The request names a model (or adapter) this server does not serve (HTTP 404, `model_not_found`).

    `served` lists the names it does serve: the base model first, then its adapters.
    """

    status_code = 404

    def __init__(self, model: str, served: tuple[str, ...]) -> None:
        names = ", ".join(repr(name) for name in served)
        super().__init__(f"the model {model!r} does not exist; this server serves {names}")
        self.model = model
        self.served = served


class AdapterError(RequestError):
    """An adapter directory cannot be served on this base model: unreadable, or shapes that do not match."""


class Overloaded(MlxTrioError):
    """The server is healthy but its bounded queue is full; retry later (HTTP 503)."""

    status_code = 503

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineFailure(MlxTrioError, RuntimeError):
    """The engine could not finish a well-formed request (HTTP 500/503)."""

    status_code = 503


class LeaseClosed(EngineFailure):
    """The GPU lease is closed or dead; no more MLX work is accepted."""


class ActorCrashed(EngineFailure):
    """An actor the request depended on died and could not resume the request."""


class EngineRestarted(EngineFailure):
    """The engine failed under a request more often than resume allows (HTTP 503, `engine_restarted`)."""


class EngineDown(EngineFailure):
    """The engine gave up after too many restarts and starts again in `retry_after_s` (HTTP 503 + Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadError(EngineFailure):
    """The model could not be found, converted or loaded."""


def error_leaves(exc: BaseException) -> Iterator[BaseException]:
    """Every error inside `exc`: the leaves of its exception groups, each followed by its causes."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from error_leaves(inner)
    else:
        # Supervisors wrap a child's failure; its cause is the useful part.
        yield exc
        if exc.__cause__ is not None:
            yield from error_leaves(exc.__cause__)
