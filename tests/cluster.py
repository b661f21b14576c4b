"""A real multi-node Ray cluster on one machine: one network namespace per node, real addresses, links that
can be throttled and cut.

    switch namespace `<prefix>-sw`: bridge br0
      ├── veth ── `<prefix>-head` eth0 10.213.7.10   ray head   {"prefill_node": 1}
      ├── veth ── `<prefix>-d1`   eth0 10.213.7.11   ray worker {"decode_node": 1}
      └── veth ── `<prefix>-d2`   eth0 10.213.7.12   ray worker {"decode_node": 1}

Every node is a `ray start --block` process (so its pid is ours) with its own `--temp-dir`, so nothing it
records (its session, `ray_current_cluster`) touches the machine's default Ray directory. Ray's token
authentication is on, as on a real deployment: `up` makes a fresh token in `<workdir>/auth_token`, which
every process `popen` starts (the nodes, a harness on the head) holds; a node without it is refused.
Traffic between nodes crosses real veth links in a private /24 that exists only inside these namespaces.
Link faults act on the switch side of a node's link: `throttle` (tbf, both directions), `cut` (link down),
`restore`.
`down` kills every process inside the namespaces (`ip netns pids`: only what this module started runs
there) and deletes them, the links and the bridge with them.

By hand (as root):

    python -m tests.cluster up        # prints the head's address; then, e.g.:
    RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/tmp/pdc/auth_token \\
        ip netns exec pdc-head pdserve serve --ray-address 10.213.7.10:6379 \\
        --prefill-resources '{"CPU": 1, "prefill_node": 1}' --decode-resources '{"CPU": 1, "decode_node": 1}'
    python -m tests.cluster throttle d1 100mbit | cut d1 | restore d1 | status
    python -m tests.cluster down
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "pdc"
SUBNET = "10.213.7"  # a private /24 that lives only inside this module's namespaces
RAY_PORT = 6379
ROOT = Path(__file__).resolve().parents[1]


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the cluster (not root, no `ip netns`); the message says why."""


@dataclass(frozen=True)
class NodeSpec:
    name: str  # "head" is the Ray head
    resources: dict[str, float] = field(default_factory=dict)
    num_cpus: int = 2


DEFAULT_NODES = (NodeSpec("head", {"prefill_node": 1}), NodeSpec("d1", {"decode_node": 1}),
                 NodeSpec("d2", {"decode_node": 1}))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=check)


def wait_for(condition, timeout: float, what: str):
    """Poll `condition` until it returns something truthy (returned); TimeoutError naming `what` after
    `timeout` seconds. For the deploy harnesses, which run outside pytest."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def check_privileges() -> None:
    """Raise ClusterUnavailable naming the reason when namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("needs root to create network namespaces and veth links")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise ClusterUnavailable("needs iproute2's `ip` and `tc` (apt-get install iproute2)")
    probe = f"{PREFIX}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        raise ClusterUnavailable(f"`ip netns add` failed: {r.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


class NetnsCluster:
    def __init__(self, nodes: tuple[NodeSpec, ...] = DEFAULT_NODES, prefix: str = PREFIX,
                 workdir: Path | None = None) -> None:
        assert nodes and nodes[0].name == "head", "the first node is the Ray head"
        self.nodes = nodes
        self.prefix = prefix
        self.workdir = workdir or Path(f"/tmp/{prefix}")
        self.procs: dict[str, subprocess.Popen] = {}

    # -- names and addresses ---------------------------------------------------------------------------

    def ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def index(self, node: str) -> int:
        return next(i for i, n in enumerate(self.nodes) if n.name == node)

    def ip(self, node: str) -> str:
        return f"{SUBNET}.{10 + self.index(node)}"

    def port_name(self, node: str) -> str:
        """The switch side of the node's link (where faults are applied)."""
        return f"{self.prefix}{self.index(node)}s"

    @property
    def address(self) -> str:
        return f"{self.ip('head')}:{RAY_PORT}"

    @property
    def token_path(self) -> Path:
        return self.workdir / "auth_token"

    # -- lifecycle -------------------------------------------------------------------------------------

    def up(self, timeout: float = 90.0) -> None:
        check_privileges()
        self.down()  # whatever an earlier run left behind
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            self._add_node(node.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token_path.unlink(missing_ok=True)
        with os.fdopen(os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        for node in self.nodes:
            self.start_ray(node.name)
            if node.name == "head":
                self._wait_log(node.name, "Ray runtime started", timeout)
        for node in self.nodes[1:]:
            self._wait_log(node.name, "Ray runtime started", timeout)

    def _add_node(self, node: str) -> None:
        ns, outer = self.ns(node), self.port_name(node)
        _ip("netns", "add", ns)
        # NOTE: both ends are made inside their namespaces: nothing is ever added to the host's own
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", outer, "netns", self.switch)
        _ip("-n", ns, "addr", "add", f"{self.ip(node)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "set", outer, "master", "br0")
        _ip("-n", self.switch, "link", "set", outer, "up")

    def start_ray(self, node: str) -> None:
        """(Re)start the node's Ray process (a node that Ray declared dead rejoins this way)."""
        spec = self.nodes[self.index(node)]
        tmp = self.workdir / node
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        args = ["ray", "start", "--block", "--node-ip-address", self.ip(node), "--num-cpus", str(spec.num_cpus),
                "--resources", json.dumps(spec.resources), "--temp-dir", str(tmp), "--disable-usage-stats"]
        if node == "head":
            args += ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"]
        else:
            args += ["--address", self.address]
        log = open(self.workdir / f"{node}.log", "w")  # noqa: SIM115 - the process owns it until it ends
        # its own session: a Ctrl-C meant for `python -m tests.cluster up` does not reach the nodes
        self.procs[node] = self.popen(node, args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait_log(self, node: str, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        path = self.workdir / f"{node}.log"
        while text not in path.read_text(errors="replace"):
            if self.procs[node].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray on {node} did not start:\n{path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    def down(self) -> None:
        """Kill every process in this cluster's namespaces, then delete them (links and bridge go too)."""
        names = [ln.split()[0] for ln in _ip("netns", "list", check=False).stdout.splitlines() if ln.strip()]
        ours = [n for n in names if n.startswith(f"{self.prefix}-")]
        for ns in ours:
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        self.procs.clear()
        for ns in ours:
            _ip("netns", "del", ns, check=False)

    # -- running things on a node ----------------------------------------------------------------------

    def popen(self, node: str, argv: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """`argv` on `node`, holding the cluster's Ray token unless `env` says otherwise."""
        full_env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        # NOTE: RAY_AUTH_TOKEN would win over the file (Ray reads RAY_AUTH_TOKEN, else RAY_AUTH_TOKEN_PATH,
        # else ~/.ray/auth_token); RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER pins to loopback, and these nodes are not
        for name in ("RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS"):
            full_env.pop(name, None)
        full_env.update(env or {})
        return subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], env=full_env, cwd=ROOT, **kw)

    # -- link faults and counters ----------------------------------------------------------------------

    def throttle(self, node: str, rate: str = "100mbit") -> None:
        """Hold the node's link to `rate` in both directions (a token bucket on each end)."""
        for ns, dev in ((self.switch, self.port_name(node)), (self.ns(node), "eth0")):
            _tc("-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                "latency", "500ms")

    def cut(self, node: str) -> None:
        _ip("-n", self.switch, "link", "set", self.port_name(node), "down")

    def restore(self, node: str) -> None:
        for ns, dev in ((self.switch, self.port_name(node)), (self.ns(node), "eth0")):
            _tc("-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
        _ip("-n", self.switch, "link", "set", self.port_name(node), "up")

    def counters(self, node: str) -> dict[str, int]:
        """Bytes through the node's eth0 so far (rx: into the node)."""
        out = {}
        for key in ("rx_bytes", "tx_bytes"):
            r = subprocess.run(["ip", "netns", "exec", self.ns(node), "cat",
                                f"/sys/class/net/eth0/statistics/{key}"], capture_output=True, text=True,
                               check=True)
            out[key] = int(r.stdout)
        return out

    def status(self) -> dict:
        return {n.name: {"ip": self.ip(n.name), "pids": _ip("netns", "pids", self.ns(n.name), check=False).stdout.split(),
                         "qdisc": _tc("-n", self.switch, "qdisc", "show", "dev", self.port_name(n.name),
                                      check=False).stdout.strip()}
                for n in self.nodes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A Ray cluster in network namespaces on this machine.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up")
    sub.add_parser("down")
    sub.add_parser("status")
    for verb in ("throttle", "cut", "restore"):
        p = sub.add_parser(verb)
        p.add_argument("node")
        if verb == "throttle":
            p.add_argument("rate", nargs="?", default="100mbit")
    args = ap.parse_args(argv)
    cluster = NetnsCluster()
    try:
        if args.cmd == "up":
            cluster.up()
            # NOTE: the `ray start --block` processes must outlive this command: detach them
            print(f"Ray head at {cluster.address}; nodes: "
                  + ", ".join(f"{n.name}={cluster.ip(n.name)} {n.resources}" for n in cluster.nodes))
            print(f"run things on a node with: ip netns exec {cluster.ns('head')} <command>")
        elif args.cmd == "down":
            cluster.down()
        elif args.cmd == "status":
            print(json.dumps(cluster.status(), indent=2))
        else:
            getattr(cluster, args.cmd)(args.node, *([args.rate] if args.cmd == "throttle" else []))
    except ClusterUnavailable as e:
        print(f"tests.cluster: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
