"""Starting the workers as Ray actors: the `Launcher` the lead's `PoolManager` is given.

NOTE: the one place the serve process touches the workers' own code: `ray.remote` needs the worker class
object, so `launch` imports `PrefillWorker` / `DecodeWorker` (and with them torch) at the first worker it
starts, never at import. The "control never imports torch" contract lists that import in its
`ignore_imports` (see pyproject.toml).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from protocol import PoolKind
from protocol.messages import RouterId
from router.pool import Launcher, PoolSpec
from router.worker_client import RayWorkerClient, WorkerClient


def ray_launcher(kv_config: Any, lease_s: float, router_id: RouterId = None,
                 detached_name: Callable[[str], tuple[str, str]] | None = None,
                 on_launch: Callable[[str, Any], None] = lambda worker_id, actor: None) -> Launcher:
    """Start workers as Ray actors: `PrefillWorker` or `DecodeWorker` (colocated: no KV transport).
    `lease_s`: how long a decode reservation outlives its last renewal. `router_id`: the starting router's,
    whose step stream the returned clients read. `detached_name(worker_id)`: (name, namespace) of a detached
    worker, which outlives the process that starts it (router replicas: another replica takes the pools
    over when the lead dies, and finds the workers by name). `on_launch(worker_id, actor)`: told of each
    actor as soon as it is created, before it is ready."""

    async def launch(spec: PoolSpec, worker_id: str) -> WorkerClient:
        from decode_worker import DecodeWorker
        from prefill_worker import PrefillWorker

        options = spec.actor_options()
        if detached_name is not None:
            name, namespace = detached_name(worker_id)
            options.update(lifetime="detached", name=name, namespace=namespace)
        if spec.kind is PoolKind.PREFILL:
            actor = _actor_class(PrefillWorker).options(**options).remote(worker_id, spec.worker_engine, kv_config)
        else:
            kv = None if spec.kind is PoolKind.COLOCATED else kv_config
            actor = _actor_class(DecodeWorker).options(**options).remote(worker_id, spec.worker_engine, kv, lease_s)
        on_launch(worker_id, actor)
        return RayWorkerClient(worker_id, actor, router_id)

    return launch


@functools.cache
def _actor_class(cls: type) -> Any:
    """`ray.remote(cls)`, made once per process.

    NOTE: each `ray.remote(cls)` is a new actor class that Ray exports (pickles and disassembles) on its first
    `.remote()`, about 70 ms on the event loop; made per start, `pdserve scale --prefill 40` froze every
    stream for 3 s."""
    import ray

    return ray.remote(cls)
