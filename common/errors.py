"""Exception types of the core.

Every error the core raises on bad input is one of these, with a message that
names the problem in one line (drivers print it, or map it to a gRPC status).
They subclass ``ValueError`` so plain callers can catch them as bad values.
"""


class HypertrainError(ValueError):
    """Base class: bad input to the core.  The message is one readable line."""


class ConfigError(HypertrainError):
    """A configuration value is invalid or inconsistent."""


class CodecError(HypertrainError):
    """Encoded bytes were rejected (corrupt, truncated, wrong codec or shape, too large)."""


class DataError(HypertrainError):
    """Token data is missing, empty or corrupt."""
