"""The Ray cluster a deployment runs on: joined at an address, or started by this process as a
single-machine cluster pinned to loopback, with Ray's token authentication on."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from control.console import ServeError, log

TOKEN_FILE = "pdserve_auth_token"  # in the Ray session directory of a cluster `pdserve serve` started


def pin_ray_to_loopback() -> None:
    """Make a Ray cluster started by this process live on 127.0.0.1. Call before `import ray`.

    NOTE: `ray.init(_node_ip_address="127.0.0.1")` alone is not enough: Ray "resolves" a loopback address
    to the machine's routable IP unless its single-machine mode is on, which this variable turns on.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # NOTE: Ray starts workers at nice 15, so any ordinary process on the box steals their CPU; the model
    # replicas are the point of this machine.
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _token_auth_for_own_cluster() -> str | None:
    """Turn Ray's token authentication on for the cluster this process is about to start (its GCS, raylet
    and workers inherit the environment), with a fresh random token unless the operator set one
    (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH): an open Ray port runs anyone's code (CVE-2023-48022), and even a
    loopback port is open to every user of the machine. Returns the token it made, if it made one."""
    os.environ["RAY_AUTH_MODE"] = "token"
    made = None
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        made = os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    from ray._raylet import AuthenticationMode, Config, get_authentication_mode

    if get_authentication_mode() != AuthenticationMode.TOKEN:
        Config.initialize("")  # Ray read RAY_AUTH_MODE when it was imported: make it read it again
    return made


def _refused_for_its_token(e: BaseException | None) -> bool:
    """Whether `ray.init` failed on the cluster's token authentication. NOTE: Ray raises a refusal by the GCS
    as a ConnectionError from a RuntimeError whose text holds the AuthenticationError (after ~20 s of
    retries)."""
    while e is not None:
        if "AuthenticationError" in f"{type(e).__name__} {e}":
            return True
        e = e.__cause__
    return False


def _join_refused(address: str) -> ServeError:
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        why = "it has token authentication on, and this process sends no token (RAY_AUTH_MODE is not token)"
    elif not any(os.environ.get(k) for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")) and \
            not (Path.home() / ".ray" / "auth_token").exists():
        why = "RAY_AUTH_MODE=token, but no token is set"
    else:
        why = ("it refused the token this process sends (RAY_AUTH_TOKEN, else RAY_AUTH_TOKEN_PATH, else "
               "~/.ray/auth_token)")
    return ServeError(
        f"cannot join the Ray cluster at {address}: {why}. Set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or "
        "RAY_AUTH_TOKEN_PATH, a file) to the token its nodes were started with; a cluster that `pdserve "
        f"serve` started keeps it in {TOKEN_FILE} in its Ray session directory (its serve's log names it)")


def init_ray(address: str | None, num_workers: int) -> None:
    """Join the Ray cluster at `address` ("auto" or HOST:PORT; with the operator's RAY_AUTH_* settings), or
    start this process's own single-machine cluster on 127.0.0.1, token-authenticated, when it is None; the
    log says which."""
    if address is None:
        pin_ray_to_loopback()
    import ray

    if ray.is_initialized():
        return
    if address:
        try:
            ctx = ray.init(address=address)
        except (ray.exceptions.AuthenticationError, ConnectionError) as e:
            if not _refused_for_its_token(e):
                raise
            raise _join_refused(address) from None
        log(f"joined the Ray cluster at {ctx.address_info.get('gcs_address', address)} "
            f"({len([n for n in ray.nodes() if n['Alive']])} nodes)")
        return
    # NOTE: RAY_AUTH_MODE=disabled, set explicitly, opts out (the test session's own cluster does)
    token_auth = os.environ.get("RAY_AUTH_MODE", "token").lower() == "token"
    made = _token_auth_for_own_cluster() if token_auth else None
    # NOTE: address="local" starts a new cluster even when Ray has one registered as this machine's
    # current cluster (`ray_current_cluster` in Ray's temp dir, left by `ray start` or a test session):
    # without it ray.init joins that one, and refuses num_cpus.
    ctx = ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                   num_cpus=max(os.cpu_count() or 1, num_workers), log_to_driver=True)
    log(f"started a new single-machine Ray cluster at {ctx.address_info.get('gcs_address')} "
        "(pass --ray-address to join an existing one)")
    if not token_auth:
        log("Ray token authentication is OFF (RAY_AUTH_MODE=disabled): any process that reaches the "
            "cluster's ports can run code in it")
    elif made:
        # the operator's other commands on this cluster (`pdserve stop`, `ray status`) need it: owner-only
        path = Path(ctx.address_info["session_dir"]) / TOKEN_FILE
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(made)
        log(f"Ray token authentication on, with a token made for this cluster; to reach it from another "
            f"process: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={path}")
    else:
        log("Ray token authentication on, with the token RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH give")
