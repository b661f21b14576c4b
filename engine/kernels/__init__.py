"""pdserve's compiled CPU kernels, built on this machine against the torch installed here: paged attention
(`cpu_kernels`) and matmuls over GGUF's quantised blocks (`gguf_kernels`), each its own module.

NOTE: built on first use with torch's own extension builder (g++ and ninja), not at `pip install` time: pip
builds a package inside an isolated environment, and a `torch` requirement there resolves to whatever torch
the index offers (a multi-GB CUDA build here), not the one the kernel will be loaded into. Built against the
running torch, the kernel's ABI always matches. The build takes about 30 s on 2 cores, once per
machine, torch version and source (the GGUF module about 20 s; cached under `$PDSERVE_KERNEL_CACHE`, default
`~/.cache/pdserve/kernels`). Concurrent builds and loads wait on an OS file lock of ours (`_build_lock`), which
the kernel drops when its holder dies. Where it cannot be built (no compiler,
`PDSERVE_KERNELS=0`), or off the CPU, attention takes its torch path and GGUF weights are dequantised at
load, and the log says so once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import cast

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name("paged_attention.cpp")]
GGUF_SOURCES = [Path(__file__).with_name("gguf_matmul.cpp")]
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17"]


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(root)


def _cpu_flags() -> str:
    """What `-march=native` compiled for: a kernel built on one CPU may not run on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _name(prefix: str = "pdserve_kernels", sources: list[Path] = SOURCES) -> str:
    h = hashlib.sha256()
    for src in sources:
        h.update(src.read_bytes())
        # NOTE: the path too: torch writes the absolute source path into the build's ninja file, so two
        # checkouts on one machine sharing a build directory rebuild it (~20-30 s) each time they alternate
        h.update(str(src.resolve()).encode())
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(sysconfig.get_config_var("EXT_SUFFIX").encode())  # (the Python it links against)
    h.update(_cpu_flags().encode())
    return f"{prefix}_{h.hexdigest()[:12]}"


def _import_built(name: str, build: Path) -> ModuleType | None:
    """The module a finished build left in `build`, imported without torch's builder; None if there is none.

    NOTE: the directory's name already hashes everything the module depends on (`_name`), so a module there
    is this one. torch's builder would run ninja again, which took 0.3 s a kernel per worker start, and
    rebuilt from scratch (20-30 s) whenever the ninja it found on PATH was another version than the last
    one's (the venv's pip `ninja` and the system's hash commands differently): a process started without
    the venv on PATH rebuilt, and the next one with it rebuilt again."""
    so = build / f"{name}.so"
    if not so.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        return None
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:  # (a build cut short: rebuild)
        log.warning("%s does not load (%s); building it again", so, e)
        return None
    return module


@contextlib.contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """One process at a time builds or loads the kernel in `build`.

    NOTE: torch's extension builder guards its build directory with a lock *file* (its `FileBaton`) that
    every later load also waits on, forever, while the file exists: a worker killed mid-build (SIGKILL,
    OOM) would leave it behind and hang every worker started on this machine afterwards. An flock is
    released by the kernel when its holder dies, so holding it proves any torch lock file there is stale."""
    with open(build / "pdserve.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that did not finish (its process died)", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The paged-attention module (`paged_attention`), or None where it cannot be had (reason logged)."""
    return _load("pdserve_kernels", SOURCES, "the paged-attention kernel", "about 30 s",
                 "attention gathers blocks and calls SDPA")


@functools.cache
def gguf_kernels() -> ModuleType | None:
    """The GGUF module (`q4_1_linear`, `q8_0_linear`, `dequantize`, and the elementwise `rms_scale` and
    `silu_mul` around a quantised layer), or None where it cannot be had."""
    return _load("pdserve_gguf", GGUF_SOURCES, "the GGUF matmul kernel", "about 20 s",
                 "GGUF weights are dequantised to float32 at load")


def _load(prefix: str, sources: list[Path], what: str, takes: str, fallback: str) -> ModuleType | None:
    if os.environ.get("PDSERVE_KERNELS", "1") == "0":
        log.info("pdserve kernels off (PDSERVE_KERNELS=0): %s", fallback)
        return None
    name = _name(prefix, sources)
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    fresh = not any(build.glob("*.so"))
    if fresh:
        print(f"pdserve: building {what} into {build} (once per machine and torch version, {takes})...",
              file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        with _build_lock(build):
            if (built := _import_built(name, build)) is not None:
                return built
            from torch.utils import cpp_extension

            mod = cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=CFLAGS,
                                     extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure falls back, with its cause named
        log.warning("pdserve's %s could not be built (%s: %s); %s instead. Install g++ and ninja "
                    "(pip install ninja) to build it, or set PDSERVE_KERNELS=0 to skip the attempt.", what,
                    type(e).__name__, str(e).splitlines()[-1:], fallback)
        return None
    if fresh:
        print(f"pdserve: built {what} in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return cast(ModuleType, mod)
