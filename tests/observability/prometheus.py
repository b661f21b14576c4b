"""A real Prometheus server for tests: its own config, storage and port, queried over its HTTP API."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMETHEUS = shutil.which("prometheus")
JOB = "pdserve"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f}s waiting for {what} (last: {result!r})")
        time.sleep(interval)


class Prometheus:
    """`prometheus` scraping `target` (host:port) every second, until `close()`."""

    def __init__(self, target: str, workdir: Path, timeout: float = 30.0) -> None:
        assert PROMETHEUS is not None, "no prometheus binary"
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics",
                                "static_configs": [{"targets": [target]}]}]}))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for("Prometheus to be ready", self._ready, timeout)
        except BaseException:
            self.close()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as res:
                return res.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as res:
            body = json.load(res)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query now: the result's series, each {"metric": labels, "value": [t, "v"]}."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def scalar(self, expr: str) -> float | None:
        """The single value `expr` gives now (None when it gives no series)."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    def wait_scraped_after(self, t: float, timeout: float = 30.0) -> None:
        """Wait for a successful scrape that started after wall-clock time `t`."""
        def scraped() -> bool:
            ts = self.scalar(f'timestamp(up{{job="{JOB}"}})')  # the scrape's time, not the query's
            return ts is not None and ts > t and self.scalar(f'up{{job="{JOB}"}}') == 1

        wait_for(f"a scrape after {t:.3f}", scraped, timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
