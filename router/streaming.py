"""One request's stream as every front door sends it: detokenized incrementally, stop strings applied,
metrics observed, and every way out (finished, stopped, cancelled, failed) closing the router's stream so
the workers free what they hold. The gRPC servicer and the OpenAI HTTP door both consume `stream_text`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from protocol import FinishReason
from router.observer import RequestObserver
from router.quotas import Ticket
from router.router import RequestState, Router, RouterError
from router.stop import StopStringMatcher
from router.validation import ValidatedRequest


@dataclass
class TextChunk:
    token_ids: list[int]
    text: str
    finish: FinishReason | None  # STOP | LENGTH on the last chunk
    state: RequestState
    completion_tokens: int  # tokens generated so far (stop-string tails included)


async def stream_text(router: Router, req: ValidatedRequest, tokenizer: Tokenizer,
                      observer: RequestObserver, ticket: Ticket | None = None) -> AsyncIterator[TextChunk]:
    """Raises RouterError (its `code` a gRPC status name) when the request cannot be served. `ticket`: the
    request's hold on its tenant's quota, told of its first token and of every token, released at the end."""
    detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids)
    stops = StopStringMatcher(req.stop)
    completion = 0
    outcome = "cancelled"
    state: RequestState | None = None
    stream = router.generate(req)
    try:
        async for event, state in stream:
            completion += len(event.token_ids)
            if ticket is not None and event.token_ids:
                ticket.first_token()
                ticket.generated(len(event.token_ids))
            stop = stops.add(detok.add(event.token_ids))
            finish = FinishReason.STOP if stop.stopped else event.finish_reason
            text = stop.text
            if finish is not None and not stop.stopped:
                tail = stops.flush()
                text += tail.text
                finish = FinishReason.STOP if tail.stopped else finish
            observer.on_event(req, state, event)
            if finish is not None:
                # NOTE: before the yield: consumers stop at the last chunk and close this generator there
                outcome = finish.value  # the metrics' label: a string at the edge
            yield TextChunk(list(event.token_ids), text, finish, state, completion)
            if finish is not None:
                return
    except RouterError:
        outcome = "error"
        raise
    finally:
        if ticket is not None:
            ticket.release()
        await stream.aclose()  # a stop string or a cancel ends the router's stream: it frees the blocks
        observer.on_end(req, state, outcome, completion)  # state is None if it never started
