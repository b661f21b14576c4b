"""The OpenAI-compatible HTTP door: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`.

FastAPI + uvicorn on the router's own event loop, in front of the same `Router` as gRPC: one placement, one
admission queue, one set of metrics, one `Door` (keys, tenants' quotas, the stalled-stream watch). A request
body is translated into the gRPC contract's `GenerateRequest` (`router.openai_request`) and validated by the
same code (`router.validation`), so both doors accept and refuse the same things; only the names in error
messages are OpenAI's. Streams are server-sent events (`router.sse`); a client that disconnects mid-stream,
or stops reading for `--stalled-stream-timeout`, cancels its request and its blocks are freed in both pools.

Hardening: a body over `MAX_BODY_BYTES` is refused while it is read (a Content-Length over it at once, 413);
a body must arrive within `body_timeout_s` (408), request headers within `header_timeout_s` (the connection
is closed: uvicorn has no header timeout of its own, `_HeaderTimeoutH11`); one client address holds at most
`max_connections_per_client` connections (more are reset as they open, before any parsing); an error the
client did not cause is a 500 with an incident id, its details in the log only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.tokenizer import Tokenizer
from router.door import Door, incident_id
from router.observer import RequestObserver
from router.openai_request import MAX_BODY_BYTES, ApiError, _openai_param, parse_body, translate
from router.quotas import QuotaExceeded
from router.router import Router, RouterError
from router.security import TLSConfig
from router.sse import SSEResponse, api_error, sse_events, usage
from router.streaming import TextChunk, stream_text
from router.tenants import KeyTable, Tenant
from router.validation import InvalidArgument, Limits, ValidatedRequest

logger = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0  # a connection's request head must arrive in this (slowloris)
BODY_TIMEOUT_S = 30.0  # its body in this, once the head is in
MAX_CONNECTIONS_PER_CLIENT = 256  # open connections from one client address (0: no cap)
# connections accepted per wake-up of the event loop: uvicorn's 2,048 lets a flood of connections queue 2,048
# transport and protocol set-ups at once, which then run in one turn, stalling every stream's tokens
ACCEPT_BATCH = 128
LISTEN_QUEUE = 2048  # the kernel's queue of connections not yet accepted (asyncio sets it to the batch first)


class HttpDoor:
    """The FastAPI app and the context it serves requests with (`router` is set once the pools are up)."""

    def __init__(self, model_name: str, tokenizer: Tokenizer, limits: Limits, observer: RequestObserver,
                 api_key: str | None = None, serving: Callable[[], bool] = lambda: True,
                 door: Door | None = None, body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        """`door`: shared with the gRPC servicer (else one of its own, keyed by `api_key`)."""
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.limits = limits
        self.observer = observer
        self.router: Router | None = None
        self.serving = serving
        self.door = door or Door(limits, tokenizer, KeyTable.single(api_key) if api_key else None)
        self.body_timeout_s = body_timeout_s
        self.created = int(time.time())
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error_handler(request: Request, e: ApiError) -> JSONResponse:
            return e.response()

        @app.exception_handler(Exception)
        async def internal_error(request: Request, e: Exception) -> JSONResponse:
            incident = incident_id()
            logger.error("HTTP %s failed (incident %s)", request.url.path, incident, exc_info=e)
            return ApiError(500, f"internal error (incident {incident}); the server's log has the details").response()

        @app.get("/health")
        async def health() -> JSONResponse:
            ok = self.router is not None and self.serving()
            return JSONResponse(status_code=200 if ok else 503, content={"status": "ok" if ok else "unavailable"})

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            self._authorize(request)
            return JSONResponse({"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "max_model_len": self.limits.max_model_len, "vocab_size": self.limits.vocab_size}]})

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._handle(request, chat=True)

        return app

    # -- one request -----------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> Tenant:
        tenant = self.door.caller(request.headers.get("authorization", ""))
        if tenant is None:
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <api key>'",
                           code="invalid_api_key")
        return tenant

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it is known to pass MAX_BODY_BYTES, or (408) when slow."""
        declared = request.headers.get("content-length", "")
        if len(declared) > 12 or (declared.isdigit() and int(declared) > MAX_BODY_BYTES):
            raise ApiError(413, f"the request body is {declared} bytes; at most {MAX_BODY_BYTES} are accepted")
        parts, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for part in request.stream():
                    size += len(part)
                    if size > MAX_BODY_BYTES:
                        raise ApiError(413, f"the request body passed {MAX_BODY_BYTES} bytes, the most accepted")
                    parts.append(part)
        except TimeoutError as e:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s:g} s") from e
        return b"".join(parts)

    async def _handle(self, request: Request, chat: bool):
        tenant = self._authorize(request)
        if self.router is None:
            raise ApiError(503, "the worker pools are still starting; retry")
        body = parse_body(await self._read_body(request))
        asked = translate(body, chat, self.model_name, self.limits.max_model_len)
        try:
            req = await self.door.validate(asked.grpc, tenant)
        except InvalidArgument as e:
            param = _openai_param(e.field)
            raise ApiError(400, f"{param}: {e.message}", param=param) from e
        try:
            ticket = await self.door.admit(tenant, req)
        except QuotaExceeded as e:
            self.observer.on_quota_refused(tenant.name, e.limit)
            return JSONResponse(status_code=429, headers={"retry-after": str(e.retry_after)},
                                content={"error": {"message": str(e), "type": "rate_limit_exceeded",
                                                   "param": None, "code": e.limit}})
        kind = "chat.completion" if chat else "text_completion"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        chunks = stream_text(self.router, req, self.tokenizer, self.observer, ticket)
        try:
            if asked.stream:
                # NOTE: the first chunk is awaited here, so placement errors (admission, no worker) still get
                # their HTTP status instead of a 200 stream that breaks at once
                first = await _unless_disconnected(request, _first(chunks), chunks)
                events = sse_events(chunks, first, req, rid, kind, self.model_name, chat, asked.include_usage)
                return SSEResponse(events, self.door.stalls)
            # NOTE: Starlette cancels a streaming response when its client leaves, not a plain one: watch for it
            return JSONResponse(await _unless_disconnected(request, self._whole(chunks, req, rid, kind, chat),
                                                           chunks))
        except BaseException:
            ticket.release()  # (the stream may never have started, so its own release never ran)
            raise

    # -- responses -------------------------------------------------------------------------------------

    async def _whole(self, chunks: AsyncIterator[TextChunk], req: ValidatedRequest, rid: str, kind: str,
                     chat: bool) -> dict:
        text, last = [], None
        try:
            async with contextlib.aclosing(chunks):
                async for c in chunks:
                    text.append(c.text)
                    last = c
                    if c.finish is not None:
                        break
        except RouterError as e:
            raise api_error(e) from e
        assert last is not None and last.finish is not None
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish.value}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice.update(text="".join(text), logprobs=None)
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name,
                "choices": [choice], "usage": usage(req, last)}


async def _unless_disconnected(request: Request, work, chunks: AsyncIterator[TextChunk]):
    """Await `work`, cancelling it (and so the request, freeing its blocks) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, RouterError, ApiError):
                    await task
                await chunks.aclose()
                raise ApiError(499, "the client closed the connection")
    finally:
        if not task.done():
            task.cancel()


async def _first(chunks: AsyncIterator[TextChunk]) -> TextChunk | None:
    try:
        return await anext(chunks, None)
    except RouterError as e:
        await chunks.aclose()
        raise api_error(e) from e


class HttpServer:
    """uvicorn on the calling event loop, on a socket bound here (so port 0 works and errors are ours)."""

    def __init__(self, door: HttpDoor, host: str, port: int, tls: TLSConfig | None = None,
                 reuse_port: bool = False, header_timeout_s: float = HEADER_TIMEOUT_S,
                 max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT) -> None:
        """`reuse_port`: share the port with other router replicas (SO_REUSEPORT: the kernel spreads the
        connections over them); `header_timeout_s`: a request head must arrive within this;
        `max_connections_per_client`: open connections one client address may hold (0: any number)."""
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.sock.bind((host.strip("[]"), port))  # OSError when taken: the caller names the flag
        self.port: int = self.sock.getsockname()[1]
        kw: dict[str, Any] = {}
        if tls is not None:
            import ssl

            kw = {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)}
            if tls.client_ca is not None:
                kw.update(ssl_ca_certs=str(tls.client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        protocol = type("HeaderTimeoutH11", (_HeaderTimeoutH11,), {
            "header_timeout_s": header_timeout_s, "max_per_client": max_connections_per_client,
            "open_by_client": collections.Counter()})
        # (ws "none": no WebSocket routes, and an upgraded connection would leave the per-address count)
        config = uvicorn.Config(door.app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=5, http=protocol, backlog=ACCEPT_BATCH, ws="none",
                                **kw)
        try:
            config.load()  # here, not in the serving task: a bad certificate fails `pdserve serve` at start
        except Exception:
            self.sock.close()
            raise
        self.server = _Uvicorn(config)
        self._task = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        self.sock.close()


class _Uvicorn(uvicorn.Server):
    # NOTE: the deployment owns SIGTERM/SIGINT (graceful drain in `serve_forever`): uvicorn must not take them
    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # NOTE: asyncio listens with the accept batch as the queue too; a burst of clients connecting at once
        # would find 128 places and wait 1 s per dropped SYN. Linux takes a new queue length on a listening
        # socket, and the batch per wake-up stays
        for sock in sockets or []:
            sock.listen(LISTEN_QUEUE)


class _HeaderTimeoutH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a request-head timeout (uvicorn has none) and a cap on connections
    per client address. A connection whose request line and headers are not all in `header_timeout_s`
    after it opened, or after the first byte of a keep-alive connection's next request, is closed, so a
    slowloris client costs a socket for that long; and one address holds at most `max_per_client`
    connections: the next is reset before uvicorn sets it up, which is the cheapest answer the event loop
    that also relays every stream's tokens can give to a flood of them."""

    header_timeout_s = HEADER_TIMEOUT_S
    max_per_client = MAX_CONNECTIONS_PER_CLIENT
    open_by_client: collections.Counter[str]  # per server (set by `HttpServer`)
    _head_timer: asyncio.TimerHandle | None = None
    _client: str | None = None  # the address this connection counts against; None: reset at once

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) else "?"  # (a Unix socket has no address)
        if self.max_per_client and self.open_by_client[client] >= self.max_per_client:
            sock = transport.get_extra_info("socket")
            if sock is not None:  # linger 0: the close is a reset, and the socket holds no state after it
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()  # uvicorn never saw it, so `connection_lost` is ours alone
            return
        self._client = client
        self.open_by_client[client] += 1
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # NOTE: h11 keeps the peer IDLE until a whole request head has been parsed
        waiting_for_head = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting_for_head and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)
        elif not waiting_for_head:
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._client is None:
            return
        self.open_by_client[self._client] -= 1
        if not self.open_by_client[self._client]:
            del self.open_by_client[self._client]
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()
