"""Core error codes to gRPC status codes: the one place the mapping lives.

The core raises :class:`KVError` with a :class:`Code`; every handler, store and
router alike, answers through :func:`abort`.
"""

from __future__ import annotations

import grpc

from kvstore.wire.errors import Code, KVError


def to_grpc(code: Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


async def abort(context: grpc.aio.ServicerContext, err: KVError) -> None:
    """End the call with ``err``'s status and message (raises, as context.abort does)."""
    await context.abort(to_grpc(err.code), err.message)
