"""`pdserve serve` as an operator runs it: it starts its own Ray cluster even when a stale one is registered
on the machine, and SIGTERM drains (the stream in flight finishes), then it exits 0.

Its own process and its own Ray cluster (`ray.init(address="local")`), started next to the test session's
one on purpose: a second cluster on the machine must not be joined by mistake.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.serving.conftest import greedy_request

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_the_stream_in_flight_then_exits(ray_cluster):
    port = _free_port()
    # a stale cluster registered as this machine's current one (what `ray start` leaves behind when its
    # processes die without `ray stop`): a plain `pdserve serve` must start its own, not try to join it.
    # NOTE: a short directory: Ray's socket paths under it must fit AF_UNIX's 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix="pdsig", dir="/tmp"))
    (tmp / "ray").mkdir()
    (tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:6390")
    env = {**os.environ, "RAY_TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-m", "control.cli", "serve", "--model", "tiny-random", "--port",
                             str(port), "--metrics-port", "off", "--worker-threads", "1", "--num-blocks", "256",
                             "--shutdown-grace", "60"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("pdserve: serving" in line for line in log):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log[-30:])
            time.sleep(0.2)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = pb_grpc.GenerationStub(channel).Generate(
                greedy_request([5, 6, 7, 8], 1000, ignore_eos=True), timeout=120)
            got = len(next(stream).token_ids)
            proc.send_signal(signal.SIGTERM)
            for r in stream:
                got += len(r.token_ids)
        assert got == 1000  # the stream in flight finished
        assert proc.wait(90) == 0
        text = "".join(log)
        assert "started a new single-machine Ray cluster" in text, text[-3000:]
        assert "for 1 request(s) in flight" in text, text[-3000:]  # the signal came mid-stream
        assert "NOT_SERVING (draining)" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
