"""Exceptions that name the problem. The server maps them to OpenAI error objects."""


class InfireError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelNotFoundError(InfireError, FileNotFoundError):
    """The model spec names no file, directory or known dummy config."""


class UnsupportedModelError(InfireError, ValueError):
    """The model exists but uses an architecture or feature we do not implement."""


class InvalidRequestError(InfireError, ValueError):
    """A request or its sampling parameters are invalid. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConfigError(InfireError, ValueError):
    """An engine, mesh or sharding configuration is invalid."""


class CorruptCheckpointError(InfireError, ValueError):
    """A checkpoint file is missing, truncated or fails its checksum: it is refused, never half-used."""


class DeviceMemoryError(InfireError, MemoryError):
    """The device ran out of memory (XLA's RESOURCE_EXHAUSTED) while a model was being placed."""
