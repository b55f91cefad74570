"""One error type for the core, mapped 1:1 onto gRPC status codes.

Core modules (registry, store, router) raise :class:`KVError` with a status
code and a message that names the field, layer and rank at fault; the thin
service layer turns it into ``context.abort(code, message)``. The core never
imports grpc for anything but the code enum.
"""

from __future__ import annotations

import grpc


class KVError(Exception):
    """A request the server refuses, with the gRPC status to answer it with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def invalid(message: str) -> KVError:
    return KVError(grpc.StatusCode.INVALID_ARGUMENT, message)


def precondition(message: str) -> KVError:
    return KVError(grpc.StatusCode.FAILED_PRECONDITION, message)


def exists(message: str) -> KVError:
    return KVError(grpc.StatusCode.ALREADY_EXISTS, message)


def not_found(message: str) -> KVError:
    return KVError(grpc.StatusCode.NOT_FOUND, message)


def exhausted(message: str) -> KVError:
    return KVError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> KVError:
    return KVError(grpc.StatusCode.UNAVAILABLE, message)


def deadline(message: str) -> KVError:
    return KVError(grpc.StatusCode.DEADLINE_EXCEEDED, message)
