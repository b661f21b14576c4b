"""A bench's results: the terminal table, the JSON file and the figure (TTFT and ITL distributions)."""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.serving.cpu import CpuShare
from benchmarks.serving.goodput import Goodput
from benchmarks.serving.stats import SLO, Summary, percentile

QUANTILES = tuple(range(101))  # the distributions kept in the JSON file, to redraw the figure from


@dataclass
class LayoutRun:
    """One layout under one workload: the run at the requested load, and the goodput search if any."""

    layout: str  # its label: 1p1d, 2c, 2p1d:round-robin, or the server's address
    description: str
    workload: str
    load: str
    summary: Summary
    ttfts: list[float]  # seconds, per completed request
    itls: list[float]  # seconds, every token gap
    by_kind: dict[str, Summary] = field(default_factory=dict)  # when the workload mixes kinds
    goodput: Goodput | None = None
    probes: list[dict] = field(default_factory=list)  # each goodput probe's rate, attainment and summary
    cpu: CpuShare | None = None  # the machine's CPU, ours and everyone else's, during the run

    def to_dict(self) -> dict:
        d = {"layout": self.layout, "description": self.description, "workload": self.workload,
             "load": self.load, "summary": self.summary.to_dict(),
             "by_kind": {k: s.to_dict() for k, s in self.by_kind.items()},
             "cpu": None if self.cpu is None else self.cpu.to_dict(),
             "quantiles": {"q": list(QUANTILES), "ttft_s": _quantiles(self.ttfts), "itl_s": _quantiles(self.itls)}}
        if self.goodput is not None:
            d["goodput"] = {"rate": self.goodput.rate, "upper": self.goodput.upper, "probes": self.probes}
        return d


def _quantiles(values: Sequence[float]) -> list[float | None]:
    return [None if math.isnan(v) else round(v, 6) for v in (percentile(values, q) for q in QUANTILES)] \
        if values else []


def _ms(p) -> str:
    return "/".join("-" if math.isnan(v) else f"{v * 1e3:.0f}" for v in p)


def _s(p) -> str:
    return "/".join("-" if math.isnan(v) else f"{v:.2f}" for v in p)


def format_table(runs: Sequence[LayoutRun], slo: SLO) -> str:
    headers = ["workload", "layout", "load", "ok/sent", "TTFT p50/90/99 ms", "ITL p50/90/99 ms",
               "E2E p50/90/99 s", "out tok/s", "req/s", f"SLO met ({slo.ttft_s:g}s, {slo.itl_s * 1e3:g}ms)",
               "cached", "goodput req/s", "others' CPU"]
    rows = []
    for r in runs:
        s = r.summary
        if r.goodput is None:
            goodput = "-"
        else:
            top = "" if r.goodput.upper is None else f" (<{r.goodput.upper:.2f})"
            goodput = f"{r.goodput.rate:.2f}{top}"
        rows.append([r.workload, r.layout, r.load, f"{s.num_completed}/{s.num_sent}", _ms(s.ttft), _ms(s.itl),
                     _s(s.e2e), f"{s.output_tokens_per_s:.1f}", f"{s.requests_per_s:.2f}",
                     f"{s.slo_attainment:.0%}", f"{s.cached_share:.0%}", goodput,
                     "-" if r.cpu is None else f"{r.cpu.others_cores:.1f} cores"])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(row) for row in rows)])


def format_probes(runs: Sequence[LayoutRun]) -> str:
    """One line per goodput search: each probe's rate, verdict, attainment and the neighbours' CPU."""
    lines = []
    for r in runs:
        if r.goodput is None:
            continue
        cells = []
        for p in r.probes:
            noise = "" if p.get("others_cores") is None else f", others {p['others_cores']:.1f} cores"
            cells.append(f"{p['rate']:.2f}/s {'pass' if p['passed'] else 'fail'} {p['slo_attainment']:.0%}{noise}")
        lines.append(f"{r.workload} {r.layout} goodput probes: " + "; ".join(cells))
    return "\n".join(lines)


def write_json(path: Path, runs: Sequence[LayoutRun], slo: SLO, command: str, settings: dict) -> None:
    doc = {"command": command, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
           "settings": settings, "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
           "runs": [r.to_dict() for r in runs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def plot(path: Path, runs: Sequence[LayoutRun], slo: SLO, title: str = "") -> None:
    """One row per workload. Left: each layout's TTFT CDF. Right: each layout's ITL tail, the share of
    token gaps longer than x on a log scale, where a stall that hits 1% of the gaps shows as a plateau at
    0.01 instead of vanishing into the top of a CDF. SLOs dashed; time on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    workloads = list(dict.fromkeys(r.workload for r in runs))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(12, 3.8 * len(workloads)), squeeze=False)
    for (ax_ttft, ax_itl), workload in zip(axes, workloads):
        for r in (r for r in runs if r.workload == workload):
            label = f"{r.layout} ({r.load})"
            xs = sorted(r.ttfts)
            if xs:
                p = r.summary.ttft
                ax_ttft.step([x * 1e3 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                             label=f"{label}: p50 {p.p50 * 1e3:.0f}, p99 {p.p99 * 1e3:.0f} ms")
            xs = sorted(r.itls)
            if xs:
                p = r.summary.itl
                ax_itl.step([x * 1e3 for x in xs], [1 - i / len(xs) for i in range(len(xs))], where="pre",
                            label=f"{label}: p50 {p.p50 * 1e3:.0f}, p99 {p.p99 * 1e3:.0f} ms")
        ax_ttft.axvline(slo.ttft_s * 1e3, color="gray", linestyle="--", linewidth=1)
        ax_ttft.set(xscale="log", xlabel="TTFT (ms; dashed: the TTFT SLO)", ylabel="fraction of requests ≤ x",
                    title=f"{workload}: time to first token")
        ax_itl.axvline(slo.itl_s * 1e3, color="gray", linestyle="--", linewidth=1)
        ax_itl.axhline(0.01, color="lightgray", linestyle=":", linewidth=1)
        ax_itl.set(xscale="log", yscale="log", xlabel="gap between tokens (ms; dashed: the ITL SLO, on a "
                   "request's mean gap)", ylabel="fraction of gaps > x (dotted: 1%)",
                   title=f"{workload}: inter-token latency tail")
        for ax in (ax_ttft, ax_itl):
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8, loc="lower left" if ax is ax_itl else "lower right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
