"""An OpenAI request body -> the gRPC contract's `GenerateRequest` (`translate`), and OpenAI's error shape.

The body is parsed defensively (`parse_body`): an integer literal longer than `MAX_INT_DIGITS` digits is
kept as a `HugeInteger` (never converted: Python refuses past 4,300 digits, and a client's 5,000-digit
`max_tokens` must be a 400 naming the field, not a 500), a string with a lone surrogate (`"\\ud800"`, valid
JSON, not valid Unicode) is refused naming its field, and so is nesting deeper than `MAX_DEPTH`.

Parameters pdserve does not implement are refused with a 400 naming them, never silently ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from protos.pdserve.v1 import generation_pb2 as pb
from router.tenants import MAX_PRIORITY

MAX_INT_DIGITS = 40  # longer integer literals are no field's value: kept as HugeInteger, refused by type
MAX_DEPTH = 16  # the deepest a body nests (messages[i].content[j] is 4 levels)
MAX_CACHE_SALT_LEN = 256
_SURROGATE = re.compile("[\ud800-\udfff]")

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
           "repetition_penalty", "min_p", "min_tokens",
           # vLLM's per-request prefix-cache salt, and its request priority
           "cache_salt", "priority"}
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


@dataclass(frozen=True)
class OpenAIRequest:
    grpc: pb.GenerateRequest  # the same request as the gRPC door would get
    stream: bool  # answer with server-sent events
    include_usage: bool  # stream_options.include_usage: a last event with the usage


class HugeInteger:
    """An integer literal too long to be any field's value (never converted to an int)."""

    def __init__(self, digits: str) -> None:
        self.num_digits = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.num_digits} digits"


def _parse_int(text: str) -> int | HugeInteger:
    return HugeInteger(text) if len(text) > MAX_INT_DIGITS else int(text)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or ApiError(400) naming what is wrong (and where)."""
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from e
    except RecursionError as e:
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from e
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_strings(body)
    return body


def _check_strings(body: dict) -> None:
    """Refuse nesting past MAX_DEPTH and strings that are not Unicode (lone surrogates), naming the field."""
    stack: list[tuple[str, Any, int]] = [(str(k), v, 1) for k, v in body.items()]
    while stack:
        path, value, depth = stack.pop()
        if _SURROGATE.search(path):
            raise ApiError(400, "a field name is not valid Unicode (a lone surrogate)")
        if depth > MAX_DEPTH:
            raise ApiError(400, f"{path}: nests deeper than {MAX_DEPTH} levels", param=path.split("[")[0])
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise ApiError(400, f"{path}: not valid Unicode (a lone surrogate such as \\ud800)",
                               param=path.split("[")[0].split(".")[0])
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}", v, depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v, depth + 1) for i, v in enumerate(value))


def translate(body: dict[str, Any], chat: bool, model_name: str, max_model_len: int) -> OpenAIRequest:
    """An OpenAI body -> the gRPC contract's request and how to answer it; ApiError names what is wrong."""
    allowed = CHAT_PARAMS if chat else COMPLETIONS_PARAMS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unsupported parameter(s): {', '.join(unknown)}", param=unknown[0],
                       code="unsupported_parameter")
    # NOTE: as vLLM does, a request that names no model gets the one this server serves
    model = body.get("model", model_name)
    if model != model_name:
        raise ApiError(404, f"The model {_short(model)} does not exist; this server serves `{model_name}`",
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
            raise ApiError(400, f"{param}: must be an integer >= 1, got {_short(max_tokens)}", param=param)
        if max_tokens >= 2**32:  # the proto field's range; said here, or the message would name the clamp
            raise ApiError(400, f"{param}: must be at most the context length {max_model_len}, "
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
        _messages(body, req)
    else:
        _prompt(body, req)
    salt = _typed(body, "cache_salt", str, None)
    if salt is not None:
        if not 0 < len(salt) <= MAX_CACHE_SALT_LEN:
            raise ApiError(400, f"cache_salt: must be 1..{MAX_CACHE_SALT_LEN} characters", param="cache_salt")
        req.cache_salt = salt
    priority = _typed(body, "priority", int, None)
    if priority is not None:
        if not 0 <= priority <= MAX_PRIORITY:
            raise ApiError(400, f"priority: must be an integer in 0..{MAX_PRIORITY}, got {priority}",
                           param="priority")
        req.priority = priority
    return OpenAIRequest(req, stream, include_usage)


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


def _typed(body: dict, name: str, types, default):
    value = body.get(name, default)
    if value is None or value is default:
        return value
    types = types if isinstance(types, tuple) else (types,)
    # NOTE: bool is an int to isinstance; `"max_tokens": true` is still a type error
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ApiError(400, f"{name}: must be {_type_name(types)}, got {_short(value)}", param=name)
    return value


def _short(value: Any, limit: int = 64) -> str:
    """A value for an error message: its repr, cut to `limit` characters (a body may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _type_name(types) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", dict: "an object", str: "a string"}
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(names.get(t, t.__name__) for t in types)


def _refuse_unless(body: dict, name: str, ok: Callable[[Any], bool], why: str) -> None:
    if name in body and not ok(body[name]):
        raise ApiError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
