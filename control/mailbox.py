"""The replicas' mailbox: a detached, named Ray actor where the router replicas of one deployment meet
(forwarded Admin calls, the lead's beat, who leads, every actor's name, a stop request)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import Any

from control.admin_servicer import Answer
from control.messages import LeadClaim, LeadInfo, ProcessInfo
from control.processes import this_node
from protocol import PoolKind
from protocol.messages import RouterId

MAILBOX_NAMESPACE = "pdserve"


def mailbox_name(port: int) -> str:
    """The mailbox actor's name: one deployment with router replicas per port and Ray cluster."""
    return f"routers-{port}"


class AdminMailbox:
    """A Ray actor (detached, named after the port): where the router replicas meet.

    - **Admin calls** that reached a replica other than the lead wait here until the lead runs them (the
      serve process is a Ray driver, which takes no calls; it polls `next`).
    - **The lead's beat**: the lead says every half second that it is alive (`beat`). When it has been
      silent for --worker-timeout, the first replica to `claim_lead` takes the pools over.
    - **Every replica's and worker's handle**, registered before it starts: a new lead adopts the replicas,
      and kills what a dead lead was still starting; the final stop kills them all.
    - **A stop request** (`pdserve stop`), which the lead's next beat picks up (a new lead's, if the lead is
      gone).
    """

    def __init__(self) -> None:
        self._inbox: asyncio.Queue[tuple[int, str, bytes]] = asyncio.Queue()
        self._answers: dict[int, asyncio.Future] = {}
        self._handed: dict[int, RouterId] = {}  # forwarded calls a lead took and has not answered: id -> lead id
        self._ids = itertools.count()
        self._lead: tuple[RouterId, int] = (None, 0)  # the lead's router id and replica index (None, 0: the serve process)
        self._beat = time.monotonic()
        self._targets: dict[PoolKind, int] = {}  # the lead's pool targets
        self._replicas: dict[int, str] = {}  # index -> router id of every replica but the lead
        self._workers: set[str] = set()  # the id of every worker ever started
        self._replica_ids: set[str] = set()  # every replica's router id ever registered
        self._incarnations = itertools.count(1)
        self._stop_grace: float | None = None
        self._closing = False  # the lead is stopping the deployment: nobody takes over any more
        self._lead_process: ProcessInfo | None = None

    async def call(self, method: str, request: bytes) -> Answer:
        n = next(self._ids)
        answer = self._answers[n] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait((n, method, request))
        try:
            return await answer
        finally:
            self._answers.pop(n, None)
            self._handed.pop(n, None)

    async def next(self, lead_id: RouterId) -> tuple[int, str, bytes] | None:
        """The next forwarded call, for the lead `lead_id`; None when that is no longer the lead (a dead
        lead's poll can still be waiting here: the call goes back for the new lead)."""
        item = await self._inbox.get()
        if lead_id != self._lead[0]:
            self._inbox.put_nowait(item)
            return None
        self._handed[item[0]] = lead_id
        return item

    async def answer(self, n: int, answer: Answer) -> None:
        fut = self._answers.get(n)
        if fut is not None and not fut.done():
            fut.set_result(answer)

    async def beat(self, lead_id: RouterId, targets: dict[PoolKind, int],
                   process: ProcessInfo | None = None) -> tuple[str, float]:
        """The lead is alive (`process`: see `processes.this_process`). Answers ("lead", 0),
        ("deposed", 0) when another replica has taken the pools over, or ("stop", grace) when an operator
        asked the deployment to stop."""
        if lead_id != self._lead[0]:
            return "deposed", 0.0
        self._beat = time.monotonic()
        self._targets = dict(targets)
        self._lead_process = process or self._lead_process
        return ("stop", self._stop_grace) if self._stop_grace is not None else ("lead", 0.0)

    async def claim_lead(self, router_id: str, index: int, silent_s: float) -> LeadClaim | None:
        """Replica `router_id` takes the lead if the lead has not beaten for `silent_s`: what it needs to take
        the pools over (the old lead's id, index and process, its pool targets, the other replicas and every
        worker ever started); None otherwise. The calls the old lead took and never answered fail now."""
        if time.monotonic() - self._beat <= silent_s or self._closing:
            return None
        old_id, old_index = self._lead
        self._lead = (router_id, index)
        self._beat = time.monotonic()
        self._replicas.pop(index, None)
        for n, taker in list(self._handed.items()):
            fut = self._answers.get(n)
            if taker == old_id and fut is not None and not fut.done():
                fut.set_result((False, ("UNAVAILABLE", "the lead router replica died while running this call; "
                                                       "check the pools (ListWorkers) and retry")))
        claim = LeadClaim(old_id, old_index, self._lead_process, dict(self._targets), dict(self._replicas),
                          tuple(sorted(self._workers)))
        self._lead_process = None
        return claim

    async def register(self, index: int, router_id: str) -> None:
        self._replicas[index] = router_id
        self._replica_ids.add(router_id)

    async def register_worker(self, worker_id: str) -> None:
        self._workers.add(worker_id)

    async def names(self) -> list[str]:
        """Every replica's and worker's name under the deployment's (see `Shared.name`), gone ones included."""
        return [f"router-{rid}" for rid in self._replica_ids] + sorted(self._workers)

    async def incarnation(self) -> int:
        """A number no replica of this deployment had: router ids stay unique across leads."""
        return next(self._incarnations)

    async def request_stop(self, grace_s: float) -> RouterId:
        """`pdserve stop`: the lead drains every replica within `grace_s`, then stops the deployment."""
        self._stop_grace = grace_s
        return self._lead[0]

    async def describe(self) -> LeadInfo:
        """Who leads (router id, replica index, process) and the other replicas' ids, for operators and tests."""
        return LeadInfo(self._lead[0], self._lead[1], self._lead_process, dict(self._replicas))

    async def restore(self, lead: tuple[RouterId, int], targets: dict[PoolKind, int], replicas: dict[int, str],
                      workers: list[str], incarnation: int) -> None:
        """A recreated mailbox (the old one died): what the lead knows, and ids from `incarnation` on."""
        self._lead, self._targets, self._replicas = lead, dict(targets), dict(replicas)
        self._replica_ids |= set(replicas.values())
        self._workers |= set(workers)
        self._incarnations = itertools.count(incarnation)
        self._beat = time.monotonic()

    async def closing(self) -> None:
        """The lead is stopping the deployment: no replica may take over from now on."""
        self._closing = True


def named(name: str) -> Any:
    """The deployment's actor called `name` (ValueError when there is none)."""
    import ray

    return ray.get_actor(name, namespace=MAILBOX_NAMESPACE)


def kill_named(name: str) -> None:
    import ray

    with contextlib.suppress(Exception):
        ray.kill(named(name))


async def create_mailbox(port: int) -> Any:
    """The deployment's mailbox, on this node (ValueError or a RayError when the name is taken)."""
    import ray

    mailbox = ray.remote(AdminMailbox).options(
        name=mailbox_name(port), namespace=MAILBOX_NAMESPACE, lifetime="detached", num_cpus=0,
        max_concurrency=1000, scheduling_strategy=this_node()).remote()
    await mailbox.incarnation.remote()  # created (a taken name fails here or above)
    return mailbox
