"""`pdserve workers | scale | drain | restart-pool`: the operator verbs, over the `pdserve.v1.Admin` API.

    pdserve workers                          # every worker: pool, state, node, load; each pool's sizes
    pdserve scale --decode 3                 # set pool sizes (up: start; down: drain the least loaded)
    pdserve drain decode-1 [--replace]       # move its sequences (with their KV) elsewhere, then retire it
    pdserve restart-pool decode              # replace each worker in turn: new one first, then drain the old

Each verb waits for the change to finish and prints what happened; every one takes the same `--server`,
TLS and API-key flags as `pdserve generate`.
"""

from __future__ import annotations

import argparse
import sys

from protocol import PoolKind

DEFAULT_SERVER = "127.0.0.1:50051"
POOLS = tuple(kind.value for kind in PoolKind)  # the CLI's spelling: the enum's values


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from router.security import add_client_args

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--server", default=DEFAULT_SERVER)
        add_client_args(p)

    def moving(p: argparse.ArgumentParser) -> None:
        p.add_argument("--method", choices=["kv", "recompute"], default="kv",
                       help="how a decode worker's running sequences go on elsewhere: kv moves their KV "
                            "(default; falls back to recompute if a move fails), recompute prefills them anew")
        p.add_argument("--timeout", type=float, default=300.0,
                       help="seconds to wait (per worker); past it what a drained worker holds fails over")

    common(sub.add_parser("workers", help="list the workers of a running server and its pools' sizes"))
    p = sub.add_parser("scale", help="set pool sizes: up starts workers, down drains the least loaded")
    for pool in POOLS:
        p.add_argument(f"--{pool}", type=int, default=None, metavar="N", help=f"workers in the {pool} pool")
    moving(p)
    common(p)
    p = sub.add_parser("drain", help="take a worker out of service without failing a request")
    p.add_argument("worker_id")
    p.add_argument("--replace", action="store_true", help="start a new worker in its place (keep the pool size)")
    moving(p)
    common(p)
    p = sub.add_parser("restart-pool", help="rolling restart: replace a pool's workers one at a time")
    p.add_argument("pool", choices=POOLS)
    moving(p)
    common(p)


def _call(args: argparse.Namespace, verb: str, rpc) -> int:
    """Run `rpc(admin stub)` over the channel the flags describe (`router.security.run_client`)."""
    from protos.pdserve.v1 import admin_pb2_grpc
    from router.security import run_client

    return run_client(args, verb, lambda channel: rpc(admin_pb2_grpc.AdminStub(channel)))


def _pool_enum(name: str) -> int:
    from protos.pdserve.v1 import generation_pb2 as gen_pb

    return gen_pb.PoolKind.Value(f"POOL_KIND_{name.upper()}")


def _method_enum(name: str) -> int:
    from protos.pdserve.v1 import admin_pb2 as pb

    return pb.MigrationMethod.Value(f"MIGRATION_METHOD_{name.upper()}")


def _pool_name(value: int) -> str:
    from protos.pdserve.v1 import generation_pb2 as gen_pb

    return gen_pb.PoolKind.Name(value).removeprefix("POOL_KIND_").lower()


def _print_drained(d) -> None:
    print(f"{d.worker_id}: {'drained' if d.clean else 'retired at the timeout'} in {d.seconds:.1f}s, moved "
          f"{d.moved_kv} by KV and {d.moved_recompute} by recompute"
          + (f", {d.blocks_held_at_exit} KV blocks held at exit" if d.HasField("blocks_held_at_exit") else "")
          + (f"; replaced by {d.replacement}" if d.replacement else ""))


def workers(args: argparse.Namespace) -> int:
    from protos.pdserve.v1 import admin_pb2 as pb

    def rpc(stub) -> None:
        res = stub.ListWorkers(pb.ListWorkersRequest())
        print(f"{'WORKER':<14}{'POOL':<11}{'STATE':<10}{'NODE':<17}{'PID':>8}{'RUN':>6}{'WAIT':>6}"
              f"{'QUEUED':>8}{'FREE/TOTAL BLOCKS':>20}")
        for w in res.workers:
            state = pb.WorkerState.Name(w.state).removeprefix("WORKER_STATE_").lower()
            print(f"{w.worker_id:<14}{_pool_name(w.pool):<11}{state:<10}{w.node_ip:<17}{w.pid:>8}"
                  f"{w.num_running:>6}{w.num_waiting:>6}{w.queued_prefill_tokens:>8}"
                  f"{f'{w.free_blocks}/{w.total_blocks}':>20}")
        for p in res.pools:
            print(f"{_pool_name(p.pool)} pool: target {p.target}, serving {p.serving}, draining {p.draining}, "
                  f"starting {p.starting}")

    return _call(args, "workers", rpc)


def scale(args: argparse.Namespace) -> int:
    from protos.pdserve.v1 import admin_pb2 as pb

    sizes = {pool: getattr(args, pool) for pool in POOLS if getattr(args, pool) is not None}
    if not sizes:
        print("pdserve scale: give at least one of --prefill N, --decode N, --colocated N", file=sys.stderr)
        return 2

    def rpc(stub) -> None:
        for pool, n in sizes.items():
            res = stub.ScalePool(pb.ScalePoolRequest(pool=_pool_enum(pool), num_workers=n,
                                                     method=_method_enum(args.method),
                                                     timeout_seconds=args.timeout), timeout=args.timeout + 30)
            p = res.pool
            print(f"{pool} pool: {p.serving} serving (target {p.target})"
                  + (f"; started {', '.join(res.started)}" if res.started else "")
                  + (f"; retired {', '.join(res.retired)}" if res.retired else ""))

    return _call(args, "scale", rpc)


def drain(args: argparse.Namespace) -> int:
    from protos.pdserve.v1 import admin_pb2 as pb

    def rpc(stub) -> None:
        _print_drained(stub.DrainWorker(pb.DrainWorkerRequest(
            worker_id=args.worker_id, method=_method_enum(args.method), replace=args.replace,
            timeout_seconds=args.timeout), timeout=args.timeout + 120))

    return _call(args, "drain", rpc)


def restart_pool(args: argparse.Namespace) -> int:
    from protos.pdserve.v1 import admin_pb2 as pb

    def rpc(stub) -> None:
        res = stub.RestartPool(pb.RestartPoolRequest(pool=_pool_enum(args.pool), method=_method_enum(args.method),
                                                     timeout_seconds=args.timeout))
        for d in res.drained:
            _print_drained(d)

    return _call(args, "restart-pool", rpc)


COMMANDS = {"workers": workers, "scale": scale, "drain": drain, "restart-pool": restart_pool}
