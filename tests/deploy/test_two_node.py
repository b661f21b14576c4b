"""pdserve on a real two-node Ray cluster: pools placed by node resources, KV across nodes, node loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def observed() -> dict:
    # NOTE: its own process, because it makes its own Ray cluster next to the test session's
    proc = subprocess.run([sys.executable, "-m", "tests.deploy.two_node_harness"], cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"harness failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


pytestmark = pytest.mark.slow


def test_every_node_is_on_loopback(observed):
    assert observed["node_ips"] == ["127.0.0.1"]


def test_pools_land_on_the_nodes_their_resources_name(observed):
    nodes = observed["nodes_before"]
    assert nodes["prefill-0"] == observed["head_node"]
    assert nodes["decode-0"] == observed["decode_node"]
    assert observed["head_node"] != observed["decode_node"]


def test_decode_follows_the_prefill_worker_onto_its_node(observed):
    nodes = observed["locality_nodes"]
    decoders = {w: n for w, n in nodes.items() if w.startswith("decode")}
    assert sorted(decoders.values()) == sorted({observed["head_node"], observed["decode_node"]})
    assert nodes["prefill-0"] == observed["head_node"]
    local = next(w for w, n in decoders.items() if n == observed["head_node"])
    assert observed["locality_served_by"] == [local] * 4


def test_greedy_output_across_nodes_equals_the_engine(observed):
    assert observed["equal"] == [True, True]
    assert observed["served_by"] == [["prefill-0", "decode-0"]] * 2


def test_kv_went_between_the_two_nodes(observed):
    assert observed["kv_bytes"] > 0
    assert all(s > 0 for s in observed["kv_transfer_seconds"])


def test_a_node_leaving_shrinks_the_pool_and_health_says_not_serving(observed):
    assert observed["health_while_gone"] == "NOT_SERVING"
    assert observed["stream_waiting_while_gone"] is True  # waiting for a decode worker, not failed


def test_a_stream_whose_decode_node_left_continues_on_the_replacement(observed):
    assert observed["mid_stream"] == "completed"
    assert observed["mid_stream_equal"] is True  # no duplicate, no missing token
    assert observed["health_after"] == "SERVING"


def test_a_node_joining_grows_the_pool_back(observed):
    assert set(observed["nodes_after"]) == {"prefill-0", "decode-1"}
    assert observed["nodes_after"]["decode-1"] == observed["new_decode_node"]
    assert observed["after_equal"] is True
    assert observed["after_served_by"] == ["prefill-0", "decode-1"]
