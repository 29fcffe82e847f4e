"""Engine error types. Only the servicer maps these to gRPC status codes.

Running out of room inside the pool is a normal return value (None); these
are what the engine raises to its callers. Each names the offending field.
"""
from __future__ import annotations


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
