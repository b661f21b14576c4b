"""How right `pdserve plan simulate` is: each run of `pdserve bench` results against its simulation.

    python -m benchmarks.planner_accuracy --profile P.json --out benchmarks/results/planner/accuracy \
        benchmarks/results/planner/acc-*.json

For every (layout, workload, rate) run in the bench files, the same trace (the bench's requests and Poisson
arrivals for its --seed, which --rounds 1 keeps whole) is simulated twice from the profile:
- as profiled: the workers share the machine's cores (the profile's `shared_cores`);
- with the neighbours: the cores the run's other processes took (the bench's `others_cores`, measured
  during that run) taken off, since this machine is shared;
- at the run's machine speed: the decode step's constants scaled by the profile's memory bandwidth index
  over the run's, and the prefill's by its matrix-multiply index over the run's
  (`benchmarks.serving.cpu.machine_speed`, probed by both), since this VM's speed drifts by a fifth within
  an hour with nothing else on it busy. (A check, not the accuracy figure: one core's probes do not
  follow that drift reliably, docs/planner.md.)
The last two use the run's measured noise, never its latencies.
Errors are |simulated - measured| / measured on TTFT p50, TTFT p90 and ITL p50.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from benchmarks.serving.launch import Layout
from planner.profile import Profile
from planner.simulator import simulate
from planner.trace import from_workload

METRICS = (("ttft", "p50"), ("ttft", "p90"), ("itl", "p50"))


def cases(paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        d = json.loads(Path(path).read_text())
        s = d["settings"]
        if s.get("rounds") != 1 or not s.get("rate"):
            raise ValueError(f"{path}: needs an open-loop run with --rounds 1 (the simulated trace is whole)")
        for run in d["runs"]:
            cpu = run.get("cpu") or {}
            out.append({"file": path, "command": d["command"], "layout": run["layout"], "workload": run["workload"],
                        "rate": s["rate"], "num_requests": s["num_requests"], "seed": s["seed"],
                        "others_cores": cpu.get("others_cores"), "memory_gbps": cpu.get("memory_gbps"),
                        "compute_gflops": cpu.get("compute_gflops"), "measured": run["summary"]})
    return out


def errors(sim: dict, measured: dict) -> dict[str, float]:
    return {f"{m}_{q}": abs(sim[f"{m}_s"][q] - measured[m][q]) / measured[m][q] for m, q in METRICS}


def at_machine_speed(profile: Profile, case: dict) -> Profile | None:
    """The profile's decode constants scaled by its memory index over the run's, its prefill constants by
    its compute index over the run's (each where both sides probed it); None where neither was."""
    out = profile
    for index, cost, fields in (("memory_gbps", "decode", ("step_s", "seq_s", "context_token_s")),
                                ("compute_gflops", "prefill", ("step_s", "token_s", "attention_s"))):
        probed = profile.samples.get(index)
        if not probed or not case.get(index):
            continue
        ratio = statistics.mean(probed) / case[index]
        c = getattr(out, cost)
        out = dataclasses.replace(out, **{cost: dataclasses.replace(
            c, **{f: getattr(c, f) * ratio for f in fields})})
    return None if out is profile else out


def evaluate(profile: Profile, case: dict) -> dict:
    trace = from_workload(case["workload"], case["rate"], case["num_requests"], case["seed"])
    layout = Layout.parse(case["layout"])
    row = dict(case)
    row["simulated"] = simulate(profile, layout, trace).summary()
    row["errors"] = errors(row["simulated"], case["measured"])
    if profile.shared_cores and case["others_cores"] is not None:
        cores = max(1.0, profile.shared_cores - case["others_cores"])
        noisy = dataclasses.replace(profile, shared_cores=cores)
        row["simulated_with_neighbours"] = simulate(noisy, layout, trace).summary() | {"shared_cores": cores}
        row["errors_with_neighbours"] = errors(row["simulated_with_neighbours"], case["measured"])
    paced = at_machine_speed(profile, case)
    if paced is not None:
        row["simulated_at_machine_speed"] = simulate(paced, layout, trace).summary()
        row["errors_at_machine_speed"] = errors(row["simulated_at_machine_speed"], case["measured"])
    return row


def table(rows: list[dict], key: str, sim_key: str) -> str:
    lines = ["| layout | workload | rate | others' CPU | TTFT p50 real / sim (err) | TTFT p90 real / sim (err) | "
             "ITL p50 real / sim (err) |", "|---|---|---:|---:|---|---|---|"]
    for r in rows:
        if key not in r:
            continue
        cells = []
        for m, q in METRICS:
            real, sim = r["measured"][m][q] * 1e3, r[sim_key][f"{m}_s"][q] * 1e3
            cells.append(f"{real:.0f} / {sim:.0f} ms ({r[key][f'{m}_{q}']:.0%})")
        cells_s = " | ".join(cells)
        lines.append(f"| {r['layout']} | {r['workload']} | {r['rate']:g} | {r['others_cores']} | {cells_s} |")
    meds = {f"{m}_{q}": statistics.median(r[key][f"{m}_{q}"] for r in rows if key in r) for m, q in METRICS}
    lines.append("| **median abs. error** | | | | **{ttft_p50:.0%}** | **{ttft_p90:.0%}** | **{itl_p50:.0%}** |"
                 .format(**meds))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench_results", nargs="+", help="pdserve bench result files (.json)")
    p.add_argument("--profile", required=True)
    p.add_argument("--out", required=True, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    profile = Profile.load(args.profile)
    rows = [evaluate(profile, c) for c in cases(args.bench_results)]
    md = ("## As profiled\n\n" + table(rows, "errors", "simulated") + "\n\n## With the run's neighbours' CPU "
          "taken off the cores\n\n" + table(rows, "errors_with_neighbours", "simulated_with_neighbours") + "\n")
    if any("errors_at_machine_speed" in r for r in rows):
        md += ("\n## At the run's machine speed (decode scaled by the memory index, prefill by the compute "
               "index: the profile's over the run's)\n\n"
               + table(rows, "errors_at_machine_speed", "simulated_at_machine_speed") + "\n")
    Path(args.out + ".json").write_text(json.dumps({"profile": args.profile, "rows": rows}, indent=1) + "\n")
    Path(args.out + ".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
