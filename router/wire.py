"""Requests whose bytes do not parse get `INVALID_ARGUMENT`, like any other bad input.

grpc-python deserializes a request before the servicer sees it, and answers a `DecodeError` (a string
field that is not UTF-8, bytes that are no protobuf at all) with `UNKNOWN` and a traceback in the log.
`add_parsing_safely` registers a servicer so that a request that fails to parse reaches its method as a
`Malformed`, which it answers with `INVALID_ARGUMENT` naming the cause, before any method code runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Malformed:
    """A request that did not parse, in place of the message."""

    message: str


def add_parsing_safely(add_to_server: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server) -> None:
    """`add_to_server(servicer, server)` (a generated `add_*Servicer_to_server`), every method's request parsed
    so that a malformed one is refused with `INVALID_ARGUMENT`."""
    add_to_server(servicer, _SafeRegistration(server))


class _SafeRegistration:
    """Stands in for the server while the generated code registers its handlers, and rewraps each one.

    NOTE: generated code registers one dict of handlers twice, as a generic handler and as registered
    methods; the dict arrives whole only in the second call, so both registrations are made from it."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: tuple) -> None:
        pass  # made from the same handlers in `add_registered_method_handlers`

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        wrapped = _wrap_all(handlers)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        self._server.add_registered_method_handlers(service, wrapped)


def _wrap_all(handlers: dict[str, grpc.RpcMethodHandler]) -> dict[str, grpc.RpcMethodHandler]:
    return {name: _wrap(h) for name, h in handlers.items()}


def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_streaming or handler.request_deserializer is None:
        return handler  # (none of ours streams requests)
    parse = handler.request_deserializer

    def safe_parse(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return Malformed(f"request: not a valid protobuf message ({e}); a string field must be UTF-8")

    if handler.response_streaming:
        inner = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in inner(request, context):
                yield response

        return handler._replace(request_deserializer=safe_parse, unary_stream=unary_stream)
    inner = handler.unary_unary

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        result = inner(request, context)
        return await result if inspect.isawaitable(result) else result

    return handler._replace(request_deserializer=safe_parse, unary_unary=unary_unary)
