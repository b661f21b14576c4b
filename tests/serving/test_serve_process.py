"""`pdserve serve` as an operator runs it, in its own process with its own Ray cluster:
- it starts that cluster even when a stale one is registered on the machine, with Ray's token authentication
  on and a token made for it: a process holding the token joins, one without it (no token, or another token)
  is refused with a message that names RAY_AUTH_TOKEN;
- SIGTERM drains (the stream in flight finishes), then it exits 0; SIGTERM while the workers load ends it
  within the grace, leaving no process behind.

The cluster is started next to the test session's one on purpose: a second cluster on the machine must not
be joined by mistake. The other side of token auth, a multi-node cluster whose nodes hold the token and a
node that does not: tests/deploy/test_netns_cluster.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.serving.conftest import free_port, greedy_request

pytestmark = pytest.mark.slow

# joins the cluster the way `pdserve stop` and `pdserve serve --ray-address` do
JOIN = ("import sys, ray; from control.ray_cluster import init_ray; init_ray(sys.argv[1], 0); "
        "print('NODES', len(ray.nodes()))")


def _check_token_auth(log: str, env: dict[str, str]) -> None:
    """The cluster in `log` asks for its token: refused without it, or with another; joined with it."""
    gcs = re.search(r"single-machine Ray cluster at (\S+) ", log).group(1)
    token_path = Path(re.search(r"RAY_AUTH_TOKEN_PATH=(\S+)", log).group(1))
    assert token_path.stat().st_mode & 0o777 == 0o600
    assert len(token_path.read_text()) == 64  # 256 random bits, made for this cluster

    def join(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", JOIN, gcs], env={**env, **extra}, capture_output=True,
                              text=True, timeout=90)

    # NOTE: one connection attempt, not Ray's 20 (a second apart), each refused alike
    for extra, why in (({}, "sends no token"), ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
                                                "it refused the token this process sends")):
        refused = join(RAY_gcs_server_port_wait_time_s="1", **extra)
        assert refused.returncode != 0 and "NODES" not in refused.stdout, (extra, refused.stdout)
        assert f"cannot join the Ray cluster at {gcs}" in refused.stderr and why in refused.stderr, \
            (extra, refused.stderr[-3000:])
        assert "Set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN" in refused.stderr
    joined = join(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    assert "NODES 1" in joined.stdout, joined.stderr[-3000:]


def test_serve_starts_its_own_cluster_with_token_auth_and_sigterm_drains_the_stream_in_flight(ray_cluster):
    port = free_port()
    # a stale cluster registered as this machine's current one (what `ray start` leaves behind when its
    # processes die without `ray stop`): a plain `pdserve serve` must start its own, not try to join it.
    # NOTE: a short directory: Ray's socket paths under it must fit AF_UNIX's 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix="pdsig", dir="/tmp"))
    (tmp / "ray").mkdir()
    (tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:6390")
    # an operator's shell: no RAY_AUTH_* at all (the test session's RAY_AUTH_MODE=disabled is its own)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")}
    env["RAY_TMPDIR"] = str(tmp)
    proc = subprocess.Popen([sys.executable, "-m", "control.cli", "serve", "--model", "tiny-random", "--port",
                             str(port), "--metrics-port", "off", "--http-port", "0", "--worker-threads", "1",
                             "--num-blocks", "256", "--shutdown-grace", "60"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180  # a busy box: a worker took 48 s to load once
        while not any("pdserve: serving" in line for line in log):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log[-30:])
            time.sleep(0.2)
        assert "started a new single-machine Ray cluster" in "".join(log), "".join(log)[-3000:]
        _check_token_auth("".join(log), env)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # the workers, on the token cluster, serve
            stream = pb_grpc.GenerationStub(channel).Generate(
                greedy_request([5, 6, 7, 8], 1000, ignore_eos=True), timeout=120)
            got = len(next(stream).token_ids)
            proc.send_signal(signal.SIGTERM)
            for r in stream:
                got += len(r.token_ids)
        assert got == 1000  # the stream in flight finished
        assert proc.wait(90) == 0
        text = "".join(log)
        assert "for 1 request(s) in flight" in text, text[-3000:]  # the signal came mid-stream
        assert "NOT_SERVING (draining)" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def _descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid` (children, their children, ...): pid -> command line."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found, todo = {}, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                found[child] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        todo.extend(children.get(child, []))
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie, already dead and waiting for its parent to reap it, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_while_the_workers_load_ends_serve_within_the_grace_and_leaves_no_process():
    """1P+2D workers loading their model when SIGTERM comes: `pdserve serve` exits within --shutdown-grace
    (before, it waited for every worker to finish loading, then drained), and no process it started (the
    workers, Ray's own) is alive afterwards."""
    grace = 12.0
    tmp = Path(tempfile.mkdtemp(prefix="pdsigw", dir="/tmp"))  # short: Ray's socket paths must fit AF_UNIX
    env = {**os.environ, "RAY_TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-m", "control.cli", "serve", "--model", "tiny-random", "--port",
                             str(free_port()), "--metrics-port", "off", "--http-port", "0",
                             "--worker-threads", "1", "--num-blocks", "256", "--prefill-workers", "1", "--decode-workers", "2",
                             "--shutdown-grace", str(grace)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while True:  # until all three worker actors exist (they are loading: the log has not said "serving")
            started = _descendants(proc.pid)
            workers = [pid for pid, cmd in started.items() if "Worker" in cmd and cmd.startswith("ray::")]
            if len(workers) >= 3:
                break
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log[-30:])
            time.sleep(0.05)
        assert not any("pdserve: serving" in line for line in log), "the workers loaded before the signal"
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(grace + 30) == 0, "".join(log[-30:])
        took = time.monotonic() - signalled
        assert took <= grace, f"exited {took:.1f}s after SIGTERM; --shutdown-grace is {grace}s"
        assert "signal received during start-up" in "".join(log)
        left = {pid: cmd for pid, cmd in started.items() if _alive(pid)}
        assert not left, left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in _descendants(proc.pid):  # (none, unless the test failed)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
