"""kv_transfer test fixtures: the rendezvous store (the router's role) and short, test-sized timeouts."""

from __future__ import annotations

import os
import sys

import pytest

# NOTE: the editable install predates kv_transfer/ and does not map it; make the repo importable (and, through
# sys.path, importable in spawned peers) until it is refreshed. The harness sits next to this file.
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(os.path.dirname(HERE)), HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

from kvx_harness import HOST  # noqa: E402

from kv_transfer import RendezvousServer  # noqa: E402


@pytest.fixture(scope="module")
def rendezvous():
    server = RendezvousServer(HOST)
    yield server
    server.close()
