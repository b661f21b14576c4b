"""The OpenAI-compatible HTTP door: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`.

FastAPI + uvicorn on the router's own event loop, in front of the same `Router` as gRPC: one placement, one
admission queue, one set of metrics. A request body is translated into the gRPC contract's
`GenerateRequest` and validated by the same code (`router.validation`), so both doors accept and refuse the
same things; only the names in error messages are OpenAI's. Streams are server-sent events exactly as
OpenAI sends them (`data: {chunk}` lines, then `data: [DONE]`); a client that disconnects mid-stream
cancels its request and its blocks are freed in both pools.

Parameters pdserve does not implement are refused with a 400 naming them, never silently ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.tokenizer import Tokenizer
from protocol import FinishReason
from protos.pdserve.v1 import generation_pb2 as pb
from router.observer import RequestObserver
from router.router import Router, RouterError
from router.security import TLSConfig
from router.streaming import TextChunk, stream_text
from router.validation import InvalidArgument, Limits, ValidatedRequest, validate_request

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "RESOURCE_EXHAUSTED": 429,
               "UNAVAILABLE": 503, "ABORTED": 503, "UNAUTHENTICATED": 401}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
              409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
              499: "client_closed_request", 503: "service_unavailable"}

# what each endpoint accepts: OpenAI's parameters pdserve implements, and those it accepts as no-ops
# because they change nothing observable (`user` is an end-user id for abuse tracking)
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
           "top_k", "ignore_eos", "user", "presence_penalty", "frequency_penalty",
           # vLLM's extensions that load tools send at their neutral values (`vllm bench serve` always
           # sends repetition_penalty=1.0): accepted at those values, refused at any other
           "repetition_penalty", "min_p", "min_tokens"}
NEUTRAL = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
           "min_tokens": (0,)}
MAX_BODY_BYTES = 4 << 20  # as gRPC's default message limit
COMPLETIONS_PARAMS = _COMMON | {"prompt", "echo", "logprobs", "best_of"}
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}

# proto field -> the OpenAI parameter a client sent
_PARAM_OF_FIELD = {"sampling.max_tokens": "max_tokens", "sampling.temperature": "temperature",
                   "sampling.top_p": "top_p", "sampling.top_k": "top_k", "sampling.stop": "stop",
                   "prompt": "prompt", "prompt_token_ids.ids": "prompt", "messages": "messages",
                   "messages.messages": "messages", "input": "prompt", "request_id": "user"}


def _openai_param(field: str) -> str:
    """The OpenAI parameter a proto field path came from: "sampling.top_p" -> "top_p",
    "messages.messages[2].role" -> "messages[2].role"."""
    if field.startswith("messages.messages["):
        return field.removeprefix("messages.")
    return _PARAM_OF_FIELD.get(field, field.split(".")[-1])


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.status, self.message, self.param,
                                                                       self.code))


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": code}}


class HttpDoor:
    """The FastAPI app and the context it serves requests with (`router` is set once the pools are up)."""

    def __init__(self, model_name: str, tokenizer: Tokenizer, limits: Limits, observer: RequestObserver,
                 api_key: str | None = None, serving: Callable[[], bool] = lambda: True) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.limits = limits
        self.observer = observer
        self.router: Router | None = None
        self.serving = serving
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self.created = int(time.time())
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, e: ApiError) -> JSONResponse:
            return e.response()

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

    def _authorize(self, request: Request) -> None:
        if self._expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self._expected):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <api key>'",
                           code="invalid_api_key")

    async def _handle(self, request: Request, chat: bool):
        self._authorize(request)
        if self.router is None:
            raise ApiError(503, "the worker pools are still starting; retry")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ApiError(400, f"the request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        grpc_req, stream, include_usage = self._translate(body, chat)
        try:
            req = validate_request(grpc_req, self.limits, self.tokenizer)
        except InvalidArgument as e:
            param = _openai_param(e.field)
            raise ApiError(400, f"{param}: {e.message}", param=param) from e
        kind = "chat.completion" if chat else "text_completion"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        chunks = stream_text(self.router, req, self.tokenizer, self.observer)
        if stream:
            # NOTE: the first chunk is awaited here, so placement errors (admission, no worker) still get
            # their HTTP status instead of a 200 stream that breaks at once
            first = await _unless_disconnected(request, _first(chunks), chunks)
            return StreamingResponse(self._sse(chunks, first, req, rid, kind, chat, include_usage),
                                     media_type="text/event-stream")
        # NOTE: Starlette cancels a streaming response when its client leaves, not a plain one: watch for it
        return JSONResponse(await _unless_disconnected(request, self._whole(chunks, req, rid, kind, chat), chunks))

    def _translate(self, body: dict[str, Any], chat: bool) -> tuple[pb.GenerateRequest, bool, bool]:
        allowed = CHAT_PARAMS if chat else COMPLETIONS_PARAMS
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise ApiError(400, f"unsupported parameter(s): {', '.join(unknown)}", param=unknown[0],
                           code="unsupported_parameter")
        # NOTE: as vLLM does, a request that names no model gets the one this server serves
        model = body.get("model", self.model_name)
        if model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        one = lambda v: v is None or (type(v) is int and v == 1)  # noqa: E731 - not True, which == 1
        _refuse_unless(body, "n", one, "only n=1 is supported")
        _refuse_unless(body, "best_of", one, "only best_of=1 is supported")
        _refuse_unless(body, "echo", lambda v: v is None or v is False, "echo is not supported")
        _refuse_unless(body, "logprobs", lambda v: v is None or v is False, "logprobs are not supported")
        _refuse_unless(body, "top_logprobs", lambda v: v is None, "logprobs are not supported")
        for name, neutral in NEUTRAL.items():
            _refuse_unless(body, name, lambda v, ok=neutral: v is None or (type(v) in (int, float) and v in ok),
                           f"{name} is not supported (only {neutral[0]})")
        stream = _typed(body, "stream", bool, False)
        options = _typed(body, "stream_options", dict, None)
        if options is not None and not stream:
            raise ApiError(400, "stream_options: only allowed with stream=true", param="stream_options")
        extra = set(options or {}) - {"include_usage"}
        if extra:
            raise ApiError(400, f"stream_options: unsupported field(s) {sorted(extra)}", param="stream_options")
        include_usage = bool((options or {}).get("include_usage", False))

        req = pb.GenerateRequest()
        s = req.sampling
        use_completion = chat and body.get("max_completion_tokens") is not None
        max_tokens = body.get("max_completion_tokens") if use_completion else body.get("max_tokens")
        if max_tokens is None and not chat:
            max_tokens = 16  # OpenAI's default for completions; chat's is the room left in the context
        if max_tokens is not None:
            param = "max_completion_tokens" if use_completion else "max_tokens"
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise ApiError(400, f"{param}: must be an integer >= 1, got {max_tokens!r}", param=param)
            if max_tokens >= 2**32:  # the proto field's range; said here, or the message would name the clamp
                raise ApiError(400, f"{param}: must be at most the context length {self.limits.max_model_len}, "
                               f"got {max_tokens}", param=param)
            s.max_tokens = max_tokens
        for name in ("temperature", "top_p"):
            value = _typed(body, name, (int, float), None)
            if value is not None:
                try:
                    setattr(s, name, float(value))
                except OverflowError as e:
                    raise ApiError(400, f"{name}: {value!r} is out of range", param=name) from e
        top_k = _typed(body, "top_k", int, None)
        if top_k is not None and top_k != -1:  # -1: vLLM's spelling of "off"
            if not 0 <= top_k < 2**31:
                raise ApiError(400, f"top_k: must be >= 0 (or -1 for no top-k), got {top_k}", param="top_k")
            s.top_k = top_k
        seed = _typed(body, "seed", int, None)
        if seed is not None:
            if not 0 <= seed < 2**63:
                raise ApiError(400, f"seed: must be in [0, 2**63), got {seed}", param="seed")
            s.seed = seed
        stop = body.get("stop")
        if isinstance(stop, str):
            s.stop.append(stop)
        elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
            s.stop.extend(stop)
        elif stop is not None:
            raise ApiError(400, "stop: must be a string or a list of strings", param="stop")
        s.ignore_eos = bool(_typed(body, "ignore_eos", bool, False))
        if chat:
            self._messages(body, req)
        else:
            self._prompt(body, req)
        return req, stream, include_usage

    @staticmethod
    def _prompt(body: dict, req: pb.GenerateRequest) -> None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            req.prompt = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            if any(not 0 <= t < 2**32 for t in prompt):
                raise ApiError(400, "prompt: token ids must be in [0, 2**32)", param="prompt")
            req.prompt_token_ids.ids.extend(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
            raise ApiError(400, "prompt: batches of several prompts are not supported; send one request each",
                           param="prompt")
        else:
            raise ApiError(400, "prompt: required, a string or a list of token ids", param="prompt")

    @staticmethod
    def _messages(body: dict, req: pb.GenerateRequest) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages: required, a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ApiError(400, f"messages[{i}]: must be an object", param="messages")
            extra = set(m) - {"role", "content", "name"}
            if extra:
                raise ApiError(400, f"messages[{i}]: unsupported field(s) {sorted(extra)} (no tools here)",
                               param="messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}]: needs a string role and string (or text parts) content",
                               param="messages")
            req.messages.messages.append(pb.ChatMessage(role=m["role"], content=content))

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
            raise _api_error(e) from e
        assert last is not None and last.finish is not None
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish.value}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice.update(text="".join(text), logprobs=None)
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name,
                "choices": [choice], "usage": _usage(req, last)}

    async def _sse(self, chunks: AsyncIterator[TextChunk], first: TextChunk | None, req: ValidatedRequest,
                   rid: str, kind: str, chat: bool, include_usage: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": created, "model": self.model_name}

        def event(payload: dict) -> bytes:
            return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

        def choice(text: str, finish: FinishReason | None, role: bool = False) -> dict:
            reason = None if finish is None else finish.value
            if chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

        last = None
        try:
            async with contextlib.aclosing(chunks):
                pending = [first] if first is not None else []
                sent_role = False
                while True:
                    c = pending.pop() if pending else await anext(chunks, None)
                    if c is None:
                        break
                    last = c
                    payload = {**base, "choices": [choice(c.text, c.finish, role=chat and not sent_role)]}
                    sent_role = True
                    if include_usage:
                        payload["usage"] = None
                    yield event(payload)
                    if c.finish is not None:
                        break
        except RouterError as e:
            # the status line is gone: OpenAI's servers send the error as an event, then end the stream
            yield event(error_body(HTTP_STATUS.get(e.code, 500), str(e), code=e.code.lower()))
        else:
            if include_usage and last is not None:
                yield event({**base, "choices": [], "usage": _usage(req, last)})
        yield b"data: [DONE]\n\n"


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
        raise _api_error(e) from e


def _usage(req: ValidatedRequest, last: TextChunk) -> dict:
    return {"prompt_tokens": req.num_prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": req.num_prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.state.num_cached_tokens}}


def _api_error(e: RouterError) -> ApiError:
    status = HTTP_STATUS.get(e.code, 500)
    param = str(e).split(":", 1)[0] if e.code == "INVALID_ARGUMENT" and ":" in str(e) else None
    return ApiError(status, str(e), param=param, code=e.code.lower())


def _typed(body: dict, name: str, types, default):
    value = body.get(name, default)
    if value is None or value is default:
        return value
    types = types if isinstance(types, tuple) else (types,)
    # NOTE: bool is an int to isinstance; `"max_tokens": true` is still a type error
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ApiError(400, f"{name}: must be {_type_name(types)}, got {value!r}", param=name)
    return value


def _type_name(types) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", dict: "an object", str: "a string"}
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(names.get(t, t.__name__) for t in types)


def _refuse_unless(body: dict, name: str, ok: Callable[[Any], bool], why: str) -> None:
    if name in body and not ok(body[name]):
        raise ApiError(400, f"{name}: {why}", param=name, code="unsupported_parameter")


class HttpServer:
    """uvicorn on the calling event loop, on a socket bound here (so port 0 works and errors are ours)."""

    def __init__(self, door: HttpDoor, host: str, port: int, tls: TLSConfig | None = None,
                 reuse_port: bool = False) -> None:
        """`reuse_port`: share the port with other router replicas (SO_REUSEPORT: the kernel spreads the
        connections over them)."""
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
        config = uvicorn.Config(door.app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=5, **kw)
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
