"""`pdserve serve` starting its own Ray cluster turns Ray's token authentication on, with a token made for
that cluster: the deployment serves, a process holding the token joins, and one without it (no token, or
another token) is refused with a message that names RAY_AUTH_TOKEN.

The other side, a multi-node cluster whose nodes hold the token and a node that does not:
tests/deploy/test_netns_cluster.py.
"""

from __future__ import annotations

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
from tests.serving.conftest import free_port, greedy_request, token_ids

pytestmark = pytest.mark.slow

# joins the cluster the way `pdserve stop` and `pdserve serve --ray-address` do
JOIN = ("import sys, ray; from control.ray_cluster import init_ray; init_ray(sys.argv[1], 0); "
        "print('NODES', len(ray.nodes()))")


def test_serve_runs_its_own_cluster_with_token_auth_and_a_process_without_the_token_is_refused():
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="pdauth", dir="/tmp"))  # short: Ray's socket paths must fit AF_UNIX
    # an operator's shell: no RAY_AUTH_* at all (the test session's RAY_AUTH_MODE=disabled is its own)
    base = {k: v for k, v in os.environ.items()
            if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")}
    base["RAY_TMPDIR"] = str(tmp)
    argv = ["serve", "--model", "tiny-random", "--port", str(port), "--metrics-port", "off",
            "--http-port", "0", "--worker-threads", "1", "--num-blocks", "64", "--prefill-workers", "0",
            "--decode-workers", "0", "--colocated-workers", "1"]  # one worker: the cheapest that serves
    proc = subprocess.Popen([sys.executable, "-m", "control.cli", *argv], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=base)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 180  # a busy box: the worker took 48 s to load once
        while not any("pdserve: serving" in line for line in log):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log[-30:])
            time.sleep(0.2)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            res = list(pb_grpc.GenerationStub(channel).Generate(greedy_request([5, 6, 7], 4, ignore_eos=True),
                                                                timeout=60))
        assert len(token_ids(res)) == 4  # the workers, on the token cluster, serve
        text = "".join(log)
        gcs = re.search(r"single-machine Ray cluster at (\S+) ", text).group(1)
        token_path = Path(re.search(r"RAY_AUTH_TOKEN_PATH=(\S+)", text).group(1))
        assert token_path.stat().st_mode & 0o777 == 0o600
        assert len(token_path.read_text()) == 64  # 256 random bits, made for this cluster

        def join(**env: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-c", JOIN, gcs], env={**base, **env}, capture_output=True,
                                  text=True, timeout=90)

        # NOTE: one connection attempt, not Ray's 20 (a second apart), each refused alike
        for env, why in (({}, "sends no token"), ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
                                                  "it refused the token this process sends")):
            refused = join(RAY_gcs_server_port_wait_time_s="1", **env)
            assert refused.returncode != 0 and "NODES" not in refused.stdout, (env, refused.stdout)
            assert f"cannot join the Ray cluster at {gcs}" in refused.stderr and why in refused.stderr, \
                (env, refused.stderr[-3000:])
            assert "Set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN" in refused.stderr
        joined = join(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
        assert "NODES 1" in joined.stdout, joined.stderr[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
