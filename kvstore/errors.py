"""Engine error types. Only the servicer maps these to gRPC status codes.

Running out of room inside the pool is a normal return value (None); these
are what the engine raises to its callers. Each names the offending field.
"""
from __future__ import annotations

QUOTE_CHARS = 64     # characters of a user-supplied value an error message shows


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """A user-supplied value as an error message shows it: its repr, cut to
    `limit` characters with its full length after. Every message quoting a
    request value goes through here: a whole 100 KB name would push the
    status past gRPC's 16 KiB metadata limit, and the client would get
    RESOURCE_EXHAUSTED "Stream removed" instead of the daemon's answer."""
    if not isinstance(value, str):
        value = repr(value)
        return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"


class KVStoreError(Exception):
    code = "INTERNAL"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InvalidArgument(KVStoreError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFound(KVStoreError, KeyError):
    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its argument; we want the sentence
        return f"{self.field}: {self.message}"


class AlreadyExists(KVStoreError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(KVStoreError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(KVStoreError):
    code = "RESOURCE_EXHAUSTED"


class Unimplemented(KVStoreError):
    code = "UNIMPLEMENTED"


class Unavailable(KVStoreError):
    code = "UNAVAILABLE"


class DataLoss(KVStoreError):
    """Stored data is not what was written (a checksum failed, a part is
    missing): refused, never served."""
    code = "DATA_LOSS"
