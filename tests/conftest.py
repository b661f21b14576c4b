"""Shared fixtures. One local Ray cluster per test session (ray.init costs ~4 s), pinned to loopback."""

from __future__ import annotations

import os

import pytest
import torch

# NOTE: Ray 2.60 enables token auth by default; a throwaway loopback cluster for tests does not need it
# (tests/serving/test_serve_process.py and the netns cluster, tests/cluster.py, run with it on).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# NOTE: without this, Ray "resolves" _node_ip_address=127.0.0.1 to the machine's network address, and
# tests must only ever talk over loopback (see control.ray_cluster.pin_ray_to_loopback).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_worker_niceness", "0")  # workers compete with the test process on equal terms


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster on 127.0.0.1 shared by every test of the session."""
    import ray

    if not ray.is_initialized():
        # address="local": the session's own cluster, never one a `ray start` on this machine left registered
        ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=8, include_dashboard=False,
                 log_to_driver=True, runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    assert ray.util.get_node_ip_address() == "127.0.0.1", "the test Ray cluster must live on loopback"
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_sessionstart(session):
    # NOTE: the kernels are built here, once, before any test starts a worker, so that no test's timing
    # includes a build (a build a chaos test kills is recovered: engine.kernels._build_lock). Where the
    # paged-attention one builds, the GGUF one must too: a silent fallback would test float32 matrices
    # under the name of GGUF blocks
    from engine.kernels import cpu_kernels, gguf_kernels

    if cpu_kernels() is not None and gguf_kernels() is None:
        raise pytest.UsageError("the paged-attention kernel built, the GGUF one did not: see the log above")
