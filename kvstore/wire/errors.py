"""One error type for every core room, with a transport-neutral code.

Core code (registry, block index, router, transfer) raises :class:`KVError`
with a :class:`Code` and a message that names the field, layer and rank at
fault. Only the service edge turns a code into a gRPC status
(``kvstore.service.status``); clients turn a status back into a code. The
codes are named after gRPC's so the mapping is by name and cannot drift.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """Why a request was refused; each maps to the gRPC status of the same name."""

    INVALID_ARGUMENT = "invalid argument"
    FAILED_PRECONDITION = "failed precondition"
    ALREADY_EXISTS = "already exists"
    NOT_FOUND = "not found"
    RESOURCE_EXHAUSTED = "resource exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline exceeded"
    PERMISSION_DENIED = "permission denied"
    UNAUTHENTICATED = "unauthenticated"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    UNKNOWN = "unknown"

    @classmethod
    def from_name(cls, name: str) -> Code:
        """The code called ``name`` (a gRPC status name), or UNKNOWN."""
        return cls.__members__.get(name, cls.UNKNOWN)


class KVError(Exception):
    """A request refused, with the code to answer it with."""

    def __init__(self, code: Code, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def invalid(message: str) -> KVError:
    return KVError(Code.INVALID_ARGUMENT, message)


def precondition(message: str) -> KVError:
    return KVError(Code.FAILED_PRECONDITION, message)


def exists(message: str) -> KVError:
    return KVError(Code.ALREADY_EXISTS, message)


def not_found(message: str) -> KVError:
    return KVError(Code.NOT_FOUND, message)


def exhausted(message: str) -> KVError:
    return KVError(Code.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> KVError:
    return KVError(Code.UNAVAILABLE, message)


def deadline(message: str) -> KVError:
    return KVError(Code.DEADLINE_EXCEEDED, message)
