"""Exception types of edgellm's public API.

Every error a user can cause derives from `EdgeLLMError`; the CLI prints its
message on one line without a traceback. Errors that are also plain value
errors (bad options) derive from `ValueError` too, so callers can catch either.
"""


class EdgeLLMError(Exception):
    """Base class of every error edgellm raises on purpose."""


class ModelNotFoundError(EdgeLLMError, FileNotFoundError):
    """The model path or short name does not exist or is not installed."""


class ModelFormatError(EdgeLLMError):
    """A model file is not what it claims to be (not GGUF, truncated, corrupt)."""


class UnsupportedArchitectureError(EdgeLLMError):
    """The model's architecture (model_type / general.architecture) is not supported."""


class TokenizerError(EdgeLLMError):
    """The tokenizer is missing or cannot be built."""


class ContextLengthError(EdgeLLMError, ValueError):
    """A prompt (plus the requested output) does not fit the model's context."""


class InvalidParameterError(EdgeLLMError, ValueError):
    """An option has an impossible value (sampling, quantization, engine)."""


class RequestFailedError(EdgeLLMError):
    """One request failed inside the engine (non-finite logits from a broken model, an
    internal error); the engine and the other requests go on."""


class OutputExistsError(EdgeLLMError, FileExistsError):
    """The output path exists and overwriting was not asked for."""
