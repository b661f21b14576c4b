"""The `pdserve.v1.Generation` gRPC service: validation, detokenizing, stop strings, status codes.

The caller's tenant (from its key, `router.door`) sets the request's cache salt and priority cap and is
charged its quotas before the request reaches the router (RESOURCE_EXHAUSTED with a `retry-after` trailer
naming the limit). Each response is handed to gRPC at the `yield`, stamped for the stalled-stream watch
(`router.stall_watch`). An error the client did not cause is answered INTERNAL with an incident id; its
details go to the log only.
"""

from __future__ import annotations

import contextlib
import logging
import time

import grpc

from engine.tokenizer import Tokenizer
from protocol import FinishReason, PoolKind
from protos.pdserve.v1 import generation_pb2 as pb
from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.door import Door, incident_id
from router.observer import RequestObserver
from router.quotas import QuotaExceeded
from router.router import RequestState, Router, RouterError
from router.streaming import stream_text
from router.validation import InvalidArgument, Limits, ValidatedRequest

logger = logging.getLogger(__name__)

FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}
POOL_KINDS = {PoolKind.PREFILL: pb.POOL_KIND_PREFILL, PoolKind.DECODE: pb.POOL_KIND_DECODE,
              PoolKind.COLOCATED: pb.POOL_KIND_COLOCATED}


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, model_name: str, tokenizer: Tokenizer, limits: Limits, block_size: int,
                 observer: RequestObserver | None = None, door: Door | None = None) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.limits = limits
        self.block_size = block_size
        self.router: Router | None = None  # set once every pool is up
        self.observer = observer or RequestObserver()
        self.door = door or Door(limits, tokenizer)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.router is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker pools are still starting; retry")
        # (the key interceptor let only known keys in: this finds whose it is)
        tenant = self.door.caller(dict(context.invocation_metadata() or ()).get("authorization", ""))
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong API key")
        try:
            req = await self.door.validate(request, tenant)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            ticket = await self.door.admit(tenant, req)
        except QuotaExceeded as e:
            self.observer.on_quota_refused(tenant.name, e.limit)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                trailing_metadata=(("retry-after", str(e.retry_after)),))
        chunks = stream_text(self.router, req, self.tokenizer, self.observer, ticket)
        stalls = self.door.stalls
        handover = stalls.watch(chunks, "grpc") if stalls is not None else None
        try:
            async with contextlib.aclosing(chunks):
                async for c in chunks:
                    res = self._response(req, c.state, c.token_ids, c.text, c.finish, c.completion_tokens)
                    if handover is None:
                        yield res
                    else:
                        handover.blocked_since = time.monotonic()
                        yield res  # returns once gRPC took it: the client's window had room
                        handover.blocked_since = None
                    if c.finish is not None:
                        return
        except RouterError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        except Exception:  # noqa: BLE001 - whatever it is, the client gets an id, the log the details
            incident = incident_id()
            logger.exception("request %s failed (incident %s)", req.request_id, incident)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error (incident {incident}, request "
                                f"{req.request_id}); the server's log has the details")
        finally:
            ticket.release()
            if handover is not None:
                stalls.forget(handover)

    def _response(self, req: ValidatedRequest, state: RequestState, token_ids: list[int], text: str,
                  finish: FinishReason | None, completion: int) -> pb.GenerateResponse:
        res = pb.GenerateResponse(request_id=req.request_id, token_ids=token_ids, text=text)
        if finish is None:
            return res
        t = state.timing
        res.finish_reason = FINISH[finish]
        res.usage.CopyFrom(pb.Usage(prompt_tokens=req.num_prompt_tokens, completion_tokens=completion,
                                    cached_prompt_tokens=state.num_cached_tokens))
        res.prefill_worker_id = state.prefill_worker
        res.decode_worker_id = state.decode_worker
        res.timing.CopyFrom(pb.Timing(queue_seconds=t.queue, prefill_seconds=t.prefill,
                                      kv_transfer_seconds=t.kv_transfer,
                                      first_decode_step_seconds=t.decode_admit,
                                      placement=state.placement.value if state.placement else ""))
        return res

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        info = pb.ModelInfo(model_name=self.model_name, max_model_len=self.limits.max_model_len,
                            vocab_size=self.limits.vocab_size, block_size=self.block_size)
        if self.router is not None:
            for kind in PoolKind:
                workers = [w for w in self.router.workers.values() if w.kind is kind and w.alive]
                if workers:
                    info.pools.append(pb.Pool(kind=POOL_KINDS[kind], name=kind.value, workers=[
                        pb.Worker(worker_id=w.worker_id, node_id=w.info.node_id) for w in workers]))
        return info
