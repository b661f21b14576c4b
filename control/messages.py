"""What crosses between the router replicas, the mailbox and the lead (Ray pickles these).

Only the control plane exchanges them (the workers never see one), so they live here, not in `protocol`.
Frozen: a message is a snapshot, never a shared mutable view of the sender's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import PoolKind
from protocol.messages import RouterId


@dataclass(frozen=True)
class ProcessInfo:
    """A process of the deployment (`processes.this_process`): what fencing it needs."""

    pid: int
    node_id: str
    # how its command line starts: the whole of it, or a Ray actor's `ray::Class` (Ray rewrites the rest);
    # a pid whose command line no longer starts with it belongs to another process now
    title: bytes = b""


@dataclass(frozen=True)
class ReplicaProcess:
    """What a router replica answers once it serves (`RouterReplica.start`, `describe_process`)."""

    pid: int
    node_id: str
    port: int
    metrics_port: int | None = None
    http_port: int | None = None

    @property
    def process(self) -> ProcessInfo:
        return ProcessInfo(self.pid, self.node_id, b"ray::RouterReplica")


@dataclass(frozen=True)
class LeadClaim:
    """What the replica that claimed the lead (`AdminMailbox.claim_lead`) needs to take the pools over."""

    old_router_id: RouterId  # None: the serve process
    old_index: int
    old_process: ProcessInfo | None  # None: the old lead never said (it beat without one)
    targets: dict[PoolKind, int]  # the old lead's pool targets
    replicas: dict[int, str]  # index -> router id of every other replica
    workers: tuple[str, ...]  # every worker ever started, sorted


@dataclass(frozen=True)
class LeadInfo:
    """Who leads (`AdminMailbox.describe`), for operators and tests."""

    lead: RouterId  # the lead's router id (None: the serve process)
    index: int
    process: ProcessInfo | None
    replicas: dict[int, str] = field(default_factory=dict)  # index -> router id of every other replica


@dataclass(frozen=True)
class ReplicaEntry:
    """One replica but the lead, as the lead's `ReplicaSet.describe` lists it."""

    index: int
    router_id: str
    process: ReplicaProcess | None  # None: it has not answered yet


@dataclass(frozen=True)
class WorkerView:
    """What one replica's router knows of one worker."""

    alive: bool
    cache_seq: int  # its prefix index's cursor in the worker's change log
    cached_blocks: int


@dataclass(frozen=True)
class ReplicaView:
    """What a replica sees (`RouterReplica.describe`): its requests in flight, and its view of each worker."""

    requests: int
    workers: dict[str, WorkerView] = field(default_factory=dict)
