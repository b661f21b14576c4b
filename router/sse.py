"""The HTTP door's streams: OpenAI's server-sent events (`sse_events`) and the response that writes them
(`SSEResponse`), watched for stalled clients.

Events are exactly OpenAI's (`data: {chunk}` lines, then `data: [DONE]`). `SSEResponse` writes them in the
request's own task (Starlette's streaming response writes from a child task of an anyio task group, which a
plain `Task.cancel` cannot end cleanly), so both ways a stream ends early are one cancellation of that task:
the client disconnected (a watcher on `receive`), or it stopped reading and the stalled-stream watch
cancelled it (`router.stall_watch`). Either way the event generator is closed, which closes the request's
`stream_text` and frees its blocks in both pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from protocol import FinishReason
from router.openai_request import HTTP_STATUS, ApiError, error_body
from router.router import RouterError
from router.stall_watch import Handover, StallWatch
from router.streaming import TextChunk
from router.validation import ValidatedRequest

__all__ = ["SSEResponse", "api_error", "sse_events", "usage"]


class SSEResponse(StreamingResponse):
    def __init__(self, events: AsyncGenerator[bytes], stalls: StallWatch | None) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events = events
        self.stalls = stalls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = asyncio.Event()

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            task.cancel()

        watcher = asyncio.ensure_future(watch_disconnect())
        handover = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            first = await anext(self.events, None)
            if self.stalls is not None:
                # NOTE: watched from here: the task is this one, and each `send` below is a hand-over
                handover = self.stalls.watch(self.events, "http")
            chunk = first
            while chunk is not None:
                if handover is not None:
                    handover.blocked_since = time.monotonic()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if handover is not None:
                    handover.blocked_since = None
                chunk = await anext(self.events, None)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not (gone.is_set() or _stalled(handover)):
                raise
            task.uncancel()  # ended on purpose: the connection closes (uvicorn closes an unfinished response)
        finally:
            watcher.cancel()
            if handover is not None and self.stalls is not None:
                self.stalls.forget(handover)
            # NOTE: "already running": the stall watch is closing the stream from its own task
            with contextlib.suppress(RuntimeError):
                await self.events.aclose()


def _stalled(handover: Handover | None) -> bool:
    return handover is not None and handover.stalled


async def sse_events(chunks: AsyncIterator[TextChunk], first: TextChunk | None, req: ValidatedRequest,
                     rid: str, kind: str, model: str, chat: bool, include_usage: bool) -> AsyncGenerator[bytes]:
    """The request's stream as OpenAI's events; `first`: the chunk already taken (placement errors need
    their HTTP status before the 200 goes out)."""
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": rid, "object": obj, "created": created, "model": model}

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
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            pending = [first] if first is not None else []
            sent_role = False
            while True:
                c = pending.pop() if pending else await anext(chunks, None)
                if c is None:
                    break
                last = c
                payload: dict[str, Any] = {**base, "choices": [choice(c.text, c.finish, role=chat and not sent_role)]}
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
            yield event({**base, "choices": [], "usage": usage(req, last)})
    yield b"data: [DONE]\n\n"


def usage(req: ValidatedRequest, last: TextChunk) -> dict:
    return {"prompt_tokens": req.num_prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": req.num_prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": last.state.num_cached_tokens}}


def api_error(e: RouterError) -> ApiError:
    status = HTTP_STATUS.get(e.code, 500)
    param = str(e).split(":", 1)[0] if e.code == "INVALID_ARGUMENT" and ":" in str(e) else None
    return ApiError(status, str(e), param=param, code=e.code.lower())
