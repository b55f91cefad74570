"""Requests whose bytes do not parse: INVALID_ARGUMENT naming the message, never UNKNOWN.

gRPC answers a deserializer that raises with UNKNOWN; the handlers built here
parse with :func:`tolerant_parser` instead, which hands the handler a
:class:`Malformed` that :func:`refuse_malformed` answers with its error.
:func:`add_service` registers a whole service this way.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

from kvstore.service import status
from kvstore.wire.errors import KVError, invalid


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes do not parse: its handler answers INVALID_ARGUMENT."""

    error: KVError


def tolerant_parser(message_type) -> Callable[[bytes], Any]:
    """``message_type.FromString`` that returns :class:`Malformed` instead of raising."""

    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as err:
            name = message_type.DESCRIPTOR.name
            return Malformed(invalid(f"request: not a valid {name} message ({err})"))

    return parse


def refuse_malformed(handler: Callable, streaming: bool) -> Callable:
    """``handler``, answering a :class:`Malformed` request with its error."""

    async def unary(request, context):
        if isinstance(request, Malformed):
            await status.abort(context, request.error)
        return await handler(request, context)

    async def stream(request, context):
        if isinstance(request, Malformed):
            await status.abort(context, request.error)
        async with contextlib.aclosing(handler(request, context)) as updates:
            async for update in updates:
                yield update

    return functools.wraps(handler)(stream if streaming else unary)


def add_service(
    server: grpc.aio.Server, service: ServiceDescriptor, messages: ModuleType, servicer: object
) -> None:
    """Register every method of ``service`` (messages from the generated module
    ``messages``) on ``server``, served by the same-named method of ``servicer``."""
    handlers = {}
    for method in service.methods:
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            refuse_malformed(getattr(servicer, method.name), method.server_streaming),
            request_deserializer=tolerant_parser(getattr(messages, method.input_type.name)),
            response_serializer=getattr(messages, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)
