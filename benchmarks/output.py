"""How a standalone benchmark hands over its summary: `--out FILE` (JSON), `--json` on stdout, else a table."""

from __future__ import annotations

import json
from collections.abc import Callable


def emit(summary: dict, out: str | None, as_json: bool, text: Callable[[dict], str]) -> None:
    """Write `summary` to `out` when given (Ray's worker notices share stdout, a file stays clean), then print
    it as JSON or as `text(summary)`."""
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2) if as_json else text(summary))
