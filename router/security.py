"""The front door's protection: TLS (optionally mutual) and an API key, for the server and its clients.

Threat model (README "Security"): clients are not trusted; the cluster network that carries KV between
workers is. So every gRPC call but health needs `authorization: Bearer <key>` when the server has a key,
and TLS keeps that key and the traffic private on the way in. Health stays open so load balancers and
orchestrators can probe without a secret; server reflection sits behind the key like everything else. With
several keys (`--api-keys`, `router.tenants`), the Admin API takes only admin keys.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from router.tenants import KeyTable

API_KEY_ENV = "PDSERVE_API_KEY"
# methods answered without a key: gRPC health checking, for load balancers and orchestrators
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
ADMIN_METHOD_PREFIX = "/pdserve.v1.Admin/"  # the operator API: admin keys only


@dataclass(frozen=True)
class TLSConfig:
    cert: Path  # PEM certificate chain the server presents
    key: Path  # its PEM private key
    client_ca: Path | None = None  # set: mutual TLS, clients must present a certificate this CA signed

    def __post_init__(self) -> None:
        for name in ("cert", "key", "client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                flag = "--tls-client-ca" if name == "client_ca" else f"--tls-{name}"
                raise ValueError(f"{flag}: no such file: {path}")

    def server_credentials(self) -> grpc.ServerCredentials:
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
                                           root_certificates=ca, require_client_auth=ca is not None)


def resolve_api_key(flag: str | None) -> str | None:
    """The key from the flag, else from PDSERVE_API_KEY; None when neither is set."""
    key = flag if flag is not None else os.environ.get(API_KEY_ENV)
    if key is None:
        return None
    key = key.strip()  # a key file from `kubectl create secret --from-file` ends with a newline
    if not key:
        raise ValueError(f"--api-key / {API_KEY_ENV} is set but empty")
    if not all("\x21" <= ch <= "\x7e" for ch in key):
        raise ValueError(f"--api-key / {API_KEY_ENV} must be visible ASCII (it travels in a header)")
    return key


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a known bearer token with UNAUTHENTICATED (health excepted), and the Admin
    API to a key whose role is not admin with PERMISSION_DENIED."""

    def __init__(self, keys: KeyTable | str) -> None:
        """`keys`: the key table (`--api-keys`), or the single `--api-key` (client and admin)."""
        self.keys = KeyTable.single(keys) if isinstance(keys, str) else keys

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        tenant = self.keys.lookup(given)  # constant time: no key oracle
        if tenant is None:
            why = "missing authorization metadata: send 'authorization: Bearer <api key>'" if not given \
                else "wrong API key"
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, why)
        if method.startswith(ADMIN_METHOD_PREFIX) and not tenant.is_admin:
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED,
                            f"the Admin API needs an admin key; this key is tenant {tenant.name!r}'s, role client")
        return handler


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with `code`."""

    async def unary(request, context):
        await context.abort(code, why)

    async def stream(request, context):
        await context.abort(code, why)
        yield  # pragma: no cover - makes this an async generator

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


# -- clients ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ClientSecurity:
    """What `pdserve generate` / `pdserve bench` need to reach a protected server."""

    tls_ca: Path | None = None  # verify the server against this CA (PEM); set -> TLS
    tls_cert: Path | None = None  # mutual TLS: this client's certificate ...
    tls_key: Path | None = None  # ... and key
    api_key: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
        return grpc.ssl_channel_credentials(read(self.tls_ca), read(self.tls_key), read(self.tls_cert))

    def metadata(self) -> Sequence[tuple[str, str]]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def channel(self, address: str) -> grpc.Channel:
        ch = grpc.secure_channel(address, self.channel_credentials()) if self.tls else grpc.insecure_channel(address)
        return grpc.intercept_channel(ch, _SyncAuth(self.metadata())) if self.api_key else ch

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        interceptors = _aio_auth(self.metadata()) if self.api_key else None
        if self.tls:
            return grpc.aio.secure_channel(address, self.channel_credentials(), interceptors=interceptors)
        return grpc.aio.insecure_channel(address, interceptors=interceptors)


def _with_metadata(details, extra: Sequence[tuple[str, str]]):
    # both APIs' call details are namedtuples
    return details._replace(metadata=list(details.metadata or ()) + list(extra))


class _SyncAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call (call credentials would need TLS; a key may travel without it on
    loopback or inside a trusted network)."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._md = metadata

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_metadata(details, self._md), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_metadata(details, self._md), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_with_metadata(details, self._md), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_with_metadata(details, self._md), request_iterator)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._md = metadata

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_metadata(details, self._md), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._md = metadata

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_metadata(details, self._md), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._md = metadata

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self._md), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._md = metadata

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_metadata(details, self._md), request_iterator)


def _aio_auth(metadata: Sequence[tuple[str, str]]) -> list:
    # NOTE: one interceptor per call type: grpc.aio files an interceptor under the first type it matches only
    return [cls(metadata) for cls in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


def add_client_args(p) -> None:
    """`--tls-ca`, `--tls-cert`, `--tls-key`, `--api-key` on a client command's argparse parser."""
    g = p.add_argument_group("reaching a protected server")
    g.add_argument("--tls-ca", default=None, help="PEM CA to verify the server with (turns TLS on)")
    g.add_argument("--tls-cert", default=None, help="mutual TLS: this client's PEM certificate")
    g.add_argument("--tls-key", default=None, help="mutual TLS: its PEM private key")
    g.add_argument("--api-key", default=None, help=f"bearer token (default: ${API_KEY_ENV})")


def client_security(args) -> ClientSecurity:
    """The parsed client flags as a ClientSecurity (ValueError names a bad flag)."""
    for flag in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"--{flag.replace('_', '-')}: no such file: {path}")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    as_path = lambda p: Path(p) if p else None  # noqa: E731
    return ClientSecurity(as_path(args.tls_ca), as_path(args.tls_cert), as_path(args.tls_key),
                          resolve_api_key(args.api_key))


def run_client(args, verb: str, call) -> int:
    """A client command's body: open the channel the flags describe (`--server` and the security flags), run
    `call(channel)`; a bad flag prints and returns 2, a gRPC error prints its status and returns 1."""
    import sys

    try:
        security = client_security(args)
    except ValueError as e:
        print(f"pdserve {verb}: {e}", file=sys.stderr)
        return 2
    with security.channel(args.server) as channel:
        try:
            call(channel)
        except grpc.RpcError as e:
            print(f"\npdserve {verb}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
