"""Errors a user can act on. Each message names what is wrong and what to do."""


class KvblendError(Exception):
    """Base class: the CLI and server print these as one clear line, never a traceback."""


class ModelNotFoundError(KvblendError):
    """A model name, folder or file that does not exist."""


class UnsupportedModelError(KvblendError):
    """An architecture, RoPE type or option kvblend does not implement."""


class ContextLengthError(KvblendError):
    """A prompt (plus requested new tokens) longer than the model's context."""


class InvalidRequestError(KvblendError, ValueError):
    """A request whose fields are out of range or inconsistent; ``field`` names the
    option at fault where one does (a server's 400 names it as its ``param``)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ModelCheckError(KvblendError):
    """A model that failed kvblend's self-check, asked for a method that reuses KV."""


class EngineClosedError(KvblendError):
    """A request sent to an engine after ``close`` (a server answers 503)."""


class NonFiniteLogitsError(KvblendError):
    """A model whose logits held NaN or inf (e.g. fp16/bf16 overflow): the request ends
    (a server answers 500: the fault is the model's or the server's, not the client's)."""
