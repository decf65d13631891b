"""Every failure a user can cause has its own exception here; each message names the fix.

The CLI prints ``str(error)`` on one line and exits 2 (traceback only with ``--debug``).
"""
from __future__ import annotations


class CpullmError(Exception):
    """Base of every user-facing cpullm error."""


# --- locating and reading a model -------------------------------------------------------
class ModelNotFoundError(CpullmError):
    """The model path or name does not exist."""


class ConfigError(CpullmError):
    """config.json is missing, not JSON, or lacks a required key."""


class UnknownModelTypeError(CpullmError):
    """No installed family handles the checkpoint's model_type."""


class UnsupportedConfigError(CpullmError):
    """A family recognises the model but not one of its settings (rope_type, layer type, ...)."""


class CheckpointError(CpullmError):
    """A safetensors file is truncated, has a bad header, or an unknown dtype."""


class WeightMapError(CpullmError):
    """Tensors are missing, unexpected, or have the wrong shape for the family's weight map."""


# --- plugins -----------------------------------------------------------------------------
class PluginError(CpullmError):
    """A plugin is broken (raised on import, returned an invalid family)."""


# --- running -----------------------------------------------------------------------------
class PromptError(CpullmError):
    """The prompt is empty or does not fit in the context."""


class ContextOverflowError(PromptError):
    """Prompt plus generated tokens would exceed the context length."""


class ContextMemoryError(ConfigError):
    """The KV cache and activations planned for the requested context do not fit in memory."""


class SamplingError(CpullmError):
    """A sampling parameter is out of range."""


class ChatTemplateError(CpullmError):
    """The model has no chat template, or its template rejected the messages."""


class TemplateLimitError(ChatTemplateError):
    """The model's chat template overran its render time or memory (runaway or hostile)."""


class TokenizerError(CpullmError):
    """tokenizer.json is missing or unreadable."""


# --- optional packages and output files ----------------------------------------------------
class MissingDependencyError(CpullmError):
    """An optional package that a requested feature needs is not installed."""


class OutputPathError(CpullmError):
    """A file the user asked cpullm to write cannot be written at that path."""


# --- caches and stores ---------------------------------------------------------------
class CacheError(CpullmError):
    """An execution or prompt cache entry is damaged, foreign, or for another model."""


class ConversionError(CpullmError):
    """A GGUF file cannot be converted (unsupported architecture or tensor type, damaged file)."""


class StoreError(CpullmError):
    """A model cannot be pulled into or found in the model store."""


class NetworkUnavailableError(StoreError):
    """A download needs a network that is not reachable."""


class ServerRequestError(CpullmError):
    """A bad HTTP request to ``cpullm serve`` (mapped to an OpenAI-style JSON error)."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.code = code


class ApiError(ServerRequestError):
    """A request field (of an HTTP request or of :meth:`cpullm.model.Model.chat`'s arguments)
    that is wrong, with the OpenAI error fields (``type``, ``param``, ``code``)."""

    def __init__(self, message: str, status: int = 400, code: str | None = None,
                 param: str | None = None, type: str | None = None):
        from .limits import one_line
        super().__init__(one_line(message, 500), status, code or "invalid_request_error")
        self.param = param
        self.openai_code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")


class ConstraintError(CpullmError):
    """A JSON schema, regular expression, grammar or choice list given to constrain the output is
    invalid, too large, or too complex (the message names the problem and where)."""
