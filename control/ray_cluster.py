"""The Ray cluster a deployment runs on: joined at an address, or started by this process as a
single-machine cluster pinned to loopback."""

from __future__ import annotations

import os

from control.console import log


def pin_ray_to_loopback() -> None:
    """Make a Ray cluster started by this process live on 127.0.0.1. Call before `import ray`.

    NOTE: `ray.init(_node_ip_address="127.0.0.1")` alone is not enough: Ray "resolves" a loopback address
    to the machine's routable IP unless its single-machine mode is on, which this variable turns on.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # NOTE: Ray starts workers at nice 15, so any ordinary process on the box steals their CPU; the model
    # replicas are the point of this machine.
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def init_ray(address: str | None, num_workers: int) -> None:
    """Join the Ray cluster at `address` ("auto" or HOST:PORT), or start this process's own single-machine
    cluster on 127.0.0.1 when it is None; the log says which."""
    if address is None:
        pin_ray_to_loopback()
    import ray

    if ray.is_initialized():
        return
    if address:
        ctx = ray.init(address=address)
        log(f"joined the Ray cluster at {ctx.address_info.get('gcs_address', address)} "
            f"({len([n for n in ray.nodes() if n['Alive']])} nodes)")
    else:
        # NOTE: address="local" starts a new cluster even when Ray has one registered as this machine's
        # current cluster (`ray_current_cluster` in Ray's temp dir, left by `ray start` or a test session):
        # without it ray.init joins that one, and refuses num_cpus.
        ctx = ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                       num_cpus=max(os.cpu_count() or 1, num_workers), log_to_driver=True)
        log(f"started a new single-machine Ray cluster at {ctx.address_info.get('gcs_address')} "
            "(pass --ray-address to join an existing one)")
