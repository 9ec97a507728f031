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


class KeyFileError(HypertrainError):
    """A key file or trusted-key list is missing, unreadable, too open or malformed."""


class UnknownKeyError(HypertrainError):
    """A key id or name is not in the pinned trusted-key list."""


class TapeError(HypertrainError):
    """An event tape failed verification or cannot be written.

    ``reason`` is the short cause ("bad signature", "broken chain", ...); ``seq``
    and ``offset`` locate the first bad entry when known (else None).
    """

    def __init__(
        self, message: str, *, reason: str = "", seq: int | None = None, offset: int | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.seq = seq
        self.offset = offset
