"""What outlives the lead of a deployment with router replicas: the names of its detached actors, the
KV rendezvous store's host actor, and how the lead makes them (`start_shared`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from dataclasses import dataclass
from typing import Any

from control.config import ServeConfig, kv_transfer_config
from control.console import ServeError
from control.launcher import ray_launcher
from control.mailbox import MAILBOX_NAMESPACE, create_mailbox, kill_named, mailbox_name, named
from control.processes import this_node
from protocol.node import node_identity
from router.pool import Launcher


class RendezvousHost:
    """A Ray actor holding the KV transfer's rendezvous store (`kv_transfer.RendezvousServer`) on its node's
    cluster address, so that the store outlives the lead (the workers' receivers listen on it).

    NOTE: it binds a port chosen before it was created, and Ray restarts it on its node when its process
    dies: the store is back at the same address, where the workers' receivers reconnect by themselves
    (`TorchKVReceiver._listen`) and senders connect per link. Links already made never needed it. What the
    store held dies with it: link requests not yet popped (their senders time out and the link is retried)."""

    def __init__(self, port: int) -> None:
        from kv_transfer.rendezvous import RendezvousServer  # (in the actor's process: see pyproject)

        self.server = RendezvousServer(node_identity()[1], port)

    def address(self) -> tuple[str, int]:
        return self.server.host, self.server.port


def _free_port(host: str) -> int:
    """A port nothing listens on at `host` now (the store binds it, and binds it again when restarted)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Shared:
    """What outlives the lead, and what a replica needs to take the pools over.

    NOTE: every detached actor of the deployment is *named* (Ray namespace `pdserve`, names under
    `routers-<port>`), and replicas find each other, the workers, the mailbox and the store by name, never
    through a handle another process passed them: a handle is owned by the process that made it, and
    nothing a new lead holds should hang on a lead that died. (Names were not enough on their own for the
    SIGSTOPped-lead case: see `_fence`.) Operators see the same names in `ray list actors`.
    """

    port: int  # the deployment's gRPC port: its names' root
    kv_config: Any  # the workers' kv_transfer.KVTransferConfig (None: colocated pools)
    lease_s: float  # how long a decode reservation outlives its last renewal
    # NOTE: only on a Ray cluster the serve process joined. One it started itself ends with it, so there is
    # nothing to take over, and fencing a merely stalled lead would end what a stall alone would not.
    failover: bool = True

    def name(self, what: str) -> str:
        """The name of one of the deployment's actors: a worker id, "router-<router id>", "rendezvous"."""
        return f"{mailbox_name(self.port)}/{what}"

    def mailbox(self) -> Any:
        return named(mailbox_name(self.port))

    def worker_name(self, worker_id: str) -> tuple[str, str]:
        """`ray_launcher`'s detached_name."""
        return self.name(worker_id), MAILBOX_NAMESPACE

    def launcher(self, router_id: str) -> Launcher:
        """Starts the deployment's workers: detached, named, registered in the mailbox before they are ready."""
        return ray_launcher(self.kv_config, self.lease_s, router_id, self.worker_name, self.register_worker)

    def register_worker(self, worker_id: str, actor: Any) -> None:
        """`ray_launcher`'s on_launch: the mailbox learns of every worker before it is ready."""
        self.mailbox().register_worker.remote(worker_id)

    async def close(self, keep: str | None) -> None:
        """After the workers: kill whatever the mailbox knows of (a worker or replica a dead lead was still
        starting) but `keep` (the caller's own name; None: the serve process, which has none), then the store (the workers held clients of it) and
        the mailbox."""
        import ray

        with contextlib.suppress(Exception):
            names = await asyncio.wait_for(self.mailbox().names.remote(), 10)
            for what in [*names, "rendezvous"]:
                if what != keep:
                    kill_named(self.name(what))
        with contextlib.suppress(Exception):
            ray.kill(self.mailbox())



def refuse_taken_port(port: int) -> None:
    """ServeError when a deployment with router replicas already has `port` in this Ray cluster."""
    with contextlib.suppress(ValueError):
        named(mailbox_name(port))
        raise ServeError(f"another pdserve deployment with router replicas serves port {port} in this Ray cluster; "
                         f"stop it with `pdserve stop --port {port}`, or pass another --port")


async def start_shared(config: ServeConfig, port: int, lease_s: float) -> tuple[Shared, Any]:
    """The lead's first step with replicas: the mailbox (refused when another deployment with replicas has
    this port in this Ray cluster) and the rendezvous store, both detached and named; the store's actor
    (None: no store), which may still be starting (`store_up`)."""
    import ray

    try:
        await create_mailbox(port)
    except (ValueError, ray.exceptions.RayError) as e:
        raise ServeError(f"another pdserve deployment with router replicas serves port {port} in this Ray "
                         f"cluster ({e}); stop it with `pdserve stop --port {port}`, or pass another --port") from e
    shared = Shared(port, None, lease_s, failover=config.ray_address is not None)
    actor, store = None, None
    if config.needs_rendezvous:
        actor, store = start_rendezvous(name=shared.name("rendezvous"))
    return dataclasses.replace(shared, kv_config=kv_transfer_config(config, store)), actor


def start_rendezvous(name: str | None = None) -> tuple[Any, tuple[str, int]]:
    """The rendezvous store: a `RendezvousHost` actor on this node, on a port chosen here. `name`: detached
    and named, restarted by Ray at the same address (a deployment with router replicas); None: a lone
    router's, which ends with the job (never restarted: nothing outlives a lone router). Its handle and the
    store's (host, port), at once.

    NOTE: not waiting for the actor lets the workers start while it does (its process and torch's import
    took 2.2 s of every deployment's start, before any worker was asked for): their store clients wait
    for it to listen (`connect_store`), and `store_up` says it does."""
    import ray

    host = node_identity()[1]
    port = _free_port(host)
    options: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": this_node(), "max_restarts": 0}
    if name is not None:
        options.update(name=name, namespace=MAILBOX_NAMESPACE, lifetime="detached", max_restarts=-1)
    return ray.remote(RendezvousHost).options(**options).remote(port), (host, port)


async def store_up(actor: Any, store: tuple[str, int]) -> None:
    """Wait for the rendezvous store `start_rendezvous` started to listen at `store`; ServeError if it
    could not (its port taken in the moment since it was chosen, its node out of memory)."""
    import ray

    try:
        where = tuple(await actor.address.remote())
    except ray.exceptions.RayError as e:
        cause = str(e).strip().splitlines()[-1]  # (the store's own error, under Ray's account of the actor)
        raise ServeError(f"the KV rendezvous store did not start at {store[0]}:{store[1]} ({cause}); "
                         "start pdserve again (the port is chosen afresh)") from e
    if where != store:
        raise ServeError(f"the KV rendezvous store listens at {where}, not at {store}, where the workers "
                         "look for it")
