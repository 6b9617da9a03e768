"""Errors raised by the engine and the model loader, carrying the data callers need."""


class EngineError(Exception):
    """Base class of the engine's own errors."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine refuses as given; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ContextLengthError(InvalidRequestError):
    """Prompt plus `max_tokens` is longer than the model's context."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens; the request asks "
            f"for {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} to generate). Shorten the prompt or lower max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class EngineStepError(EngineError):
    """A step failed in a way no single request explains (every request failed alone)."""


class RequestFailedError(EngineError):
    """The engine failed this one request (finish reason `error`); the others go on."""


class CheckpointError(EngineError):
    """A checkpoint directory that cannot be loaded: missing file, bad shape, unknown model."""


class ModelFetchError(EngineError):
    """A known model that cannot be fetched: unknown name, failed download, bad checksum."""
