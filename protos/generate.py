"""Regenerate the Python (`*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py`) next to every `.proto` under `protos/`.

    python -m protos.generate            # in place
    python -m protos.generate --out DIR  # elsewhere (the up-to-date test compares the two)

Protos are compiled with `protos/` as the include root, so each file keeps its canonical name
(`pdserve/v1/generation.proto`, what gRPC reflection serves and what other languages' clients compile) and
its package matches its directory. protoc's Python imports between generated modules then read
`from pdserve.v1 import ...`; the one rewrite below roots them under our `protos` package instead, so no
`sys.path` trick is needed to import them.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Every `.proto` under `root`, relative to it, in a stable order."""
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def _root_imports(text: str, packages: set[str]) -> str:
    # NOTE: protoc emits imports of generated modules only as `from <package path> import <module> as ...`,
    # in both the .py and the .pyi; `import pdserve...` never appears, so one pattern covers every case.
    pattern = re.compile(rf"^(\s*)from ({'|'.join(map(re.escape, sorted(packages)))})([.\s])", re.MULTILINE)
    return pattern.sub(r"\1from protos.\2\3", text)


def generate(out_dir: Path = PROTO_ROOT, root: Path = PROTO_ROOT) -> list[Path]:
    """Compile every `.proto` under `root` into `out_dir` (same relative layout); returns the files written,
    relative to `out_dir`."""
    from grpc_tools import protoc

    protos = proto_files(root)
    assert protos, f"no .proto files under {root}"
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *map(str, protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    packages = {p.parts[0] for p in protos}
    written = []
    for proto in protos:
        for suffix in GENERATED_SUFFIXES:
            rel = proto.with_name(proto.stem + suffix)
            path = out_dir / rel
            text = _root_imports(path.read_text(), packages)
            if suffix.endswith(".pyi"):
                # NOTE: pyproject's ruff exclude (`*_pb2*.py`) covers the generated modules but not their
                # stubs, whose protoc style (typing.Optional, unsorted imports) ruff would flag.
                text = "# ruff: noqa\n" + text
            path.write_text(text)
            written.append(rel)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: next to the protos)")
    args = parser.parse_args(argv)
    for rel in generate(args.out):
        print(args.out / rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
