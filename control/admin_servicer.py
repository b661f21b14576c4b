"""The `pdserve.v1.Admin` gRPC service: `control.admin.PoolAdmin` on the wire."""

from __future__ import annotations

import grpc

from control.admin import DEFAULT_TIMEOUT_S, AdminError, DrainOutcome, PoolAdmin, PoolSize
from protocol import Method, PoolKind
from protos.pdserve.v1 import admin_pb2 as pb
from protos.pdserve.v1 import admin_pb2_grpc as pb_grpc
from router.servicer import POOL_KINDS

POOLS = POOL_KINDS  # the wire's spelling of a pool kind, one table for both services
KINDS = {v: k for k, v in POOLS.items()}
METHODS = {pb.MIGRATION_METHOD_UNSPECIFIED: Method.KV, pb.MIGRATION_METHOD_KV: Method.KV,
           pb.MIGRATION_METHOD_RECOMPUTE: Method.RECOMPUTE}


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self) -> None:
        self.admin: PoolAdmin | None = None  # set once every pool is up

    async def ListWorkers(self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext):
        admin = await self._admin(context)
        res = pb.ListWorkersResponse(pools=[_pool(s) for s in admin.sizes()])
        for w in admin.workers():
            ld = w.load
            res.workers.append(pb.WorkerStatus(
                worker_id=w.worker_id, pool=POOLS[w.kind],
                state=pb.WORKER_STATE_DRAINING if w.draining else pb.WORKER_STATE_SERVING,
                node_id=w.info.node_id, node_ip=w.info.node_ip, pid=w.info.pid, num_running=ld.num_running,
                num_waiting=ld.num_waiting, queued_prefill_tokens=w.snapshot().queued_prefill_tokens,
                free_blocks=ld.free_blocks, total_blocks=ld.total_blocks))
        return res

    async def ScalePool(self, request: pb.ScalePoolRequest, context: grpc.aio.ServicerContext):
        admin = await self._admin(context)
        kind = await _kind(request.pool, context)
        try:
            out = await admin.scale(kind, request.num_workers, await _method(request.method, context),
                                    await _timeout(request.timeout_seconds, context))
        except AdminError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        return pb.ScalePoolResponse(pool=_pool(out.pool), started=out.started, retired=out.retired)

    async def DrainWorker(self, request: pb.DrainWorkerRequest, context: grpc.aio.ServicerContext):
        admin = await self._admin(context)
        if not request.worker_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id: required (pdserve workers lists them)")
        try:
            out = await admin.drain(request.worker_id, await _method(request.method, context), request.replace,
                                    await _timeout(request.timeout_seconds, context))
        except AdminError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        return _drained(out)

    async def RestartPool(self, request: pb.RestartPoolRequest, context: grpc.aio.ServicerContext):
        admin = await self._admin(context)
        kind = await _kind(request.pool, context)
        try:
            outs = await admin.restart(kind, await _method(request.method, context),
                                       await _timeout(request.timeout_seconds, context))
        except AdminError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), str(e))
        return pb.RestartPoolResponse(drained=[_drained(o) for o in outs])

    async def _admin(self, context: grpc.aio.ServicerContext) -> PoolAdmin:
        if self.admin is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker pools are still starting; retry")
        return self.admin


def _pool(size: PoolSize) -> pb.PoolStatus:
    return pb.PoolStatus(pool=POOLS[size.pool], target=size.target, serving=size.serving, draining=size.draining,
                         starting=size.starting)


def _drained(out: DrainOutcome) -> pb.DrainWorkerResponse:
    return pb.DrainWorkerResponse(worker_id=out.worker_id, moved_kv=out.moved.get(Method.KV, 0),
                                  moved_recompute=out.moved.get(Method.RECOMPUTE, 0), clean=out.clean,
                                  replacement=out.replacement, seconds=out.seconds,
                                  blocks_held_at_exit=out.blocks_held_at_exit)


async def _kind(pool: int, context: grpc.aio.ServicerContext) -> PoolKind:
    if pool not in KINDS:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            "pool: must be POOL_KIND_PREFILL, POOL_KIND_DECODE or POOL_KIND_COLOCATED")
    return KINDS[pool]


async def _method(method: int, context: grpc.aio.ServicerContext) -> Method:
    if method not in METHODS:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"method: unknown migration method {method}")
    return METHODS[method]


async def _timeout(seconds: float, context: grpc.aio.ServicerContext) -> float:
    if seconds < 0 or seconds != seconds:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_seconds: must be >= 0, got {seconds}")
    return seconds or DEFAULT_TIMEOUT_S


# -- router replicas: Admin calls that reach a replica other than the lead ------------------------------

RPCS = {"ListWorkers": (pb.ListWorkersRequest, pb.ListWorkersResponse),
        "ScalePool": (pb.ScalePoolRequest, pb.ScalePoolResponse),
        "DrainWorker": (pb.DrainWorkerRequest, pb.DrainWorkerResponse),
        "RestartPool": (pb.RestartPoolRequest, pb.RestartPoolResponse)}

# a forwarded call's answer: (True, the response's bytes) or (False, (status code name, details))
Answer = tuple[bool, bytes | tuple[str, str]]


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _LocalContext:
    """What `AdminServicer` needs of a gRPC context, for a call another replica forwarded."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Refused(code, details)


async def run_forwarded(servicer: AdminServicer, method: str, request: bytes) -> Answer:
    """Run an Admin call another router replica forwarded (on the lead, which holds the pools)."""
    if method not in RPCS:
        return False, ("UNIMPLEMENTED", f"unknown Admin method {method!r}")
    try:
        response = await getattr(servicer, method)(RPCS[method][0].FromString(request), _LocalContext())
    except _Refused as e:
        return False, (e.code.name, e.details)
    except Exception as e:  # noqa: BLE001 - the forwarding replica's client gets it as INTERNAL
        return False, ("INTERNAL", f"{type(e).__name__}: {e}")
    return True, response.SerializeToString()


class ForwardingAdminServicer(pb_grpc.AdminServicer):
    """`pdserve.v1.Admin` on a router replica that is not the lead: every call runs on the lead (which holds
    the pools), through `mailbox` (a `control.mailbox.AdminMailbox` actor); status and details come back as
    the lead gave them."""

    def __init__(self, mailbox) -> None:
        self.mailbox = mailbox

    async def _forward(self, method: str, request, context: grpc.aio.ServicerContext):
        import ray

        try:
            ok, payload = await self.mailbox.call.remote(method, request.SerializeToString())
        except ray.exceptions.RayError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the lead router replica, which holds the pools, "
                                                             f"is gone ({type(e).__name__}); retry once it is back")
        if not ok:
            code, details = payload
            await context.abort(getattr(grpc.StatusCode, code), details)
        return RPCS[method][1].FromString(payload)

    async def ListWorkers(self, request, context):
        return await self._forward("ListWorkers", request, context)

    async def ScalePool(self, request, context):
        return await self._forward("ScalePool", request, context)

    async def DrainWorker(self, request, context):
        return await self._forward("DrainWorker", request, context)

    async def RestartPool(self, request, context):
        return await self._forward("RestartPool", request, context)
