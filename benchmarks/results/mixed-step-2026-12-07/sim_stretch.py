"""The simulator with every mixed step (prompt chunk + decode rows) stretched 1.08x, against the stored
accuracy campaigns: median errors and the colocated (2c) cases, 1.0 (as is) and 1.08. An experiment, not
adopted (docs/planner.md).

    python benchmarks/results/mixed-step-2026-12-07/sim_stretch.py  # output: sim-stretch.txt
"""
import dataclasses
import glob
import statistics

import planner.workers as W
from benchmarks.planner_accuracy import cases, evaluate
from planner.profile import Profile

orig = W.SimWorker.plan_step
def patched(factor):
    def plan_step(self, slowdown=lambda _p: 1.0):
        step = orig(self, slowdown)
        if step.chunks and step.decode_rows:
            step = dataclasses.replace(step, duration_s=step.duration_s * factor)
            self.step = step
        return step
    return plan_step

for camp in ["2026-12-06-speed", "2026-12-06-probe", "2026-12-06-late", "2026-12-06-night"]:
    d = f"benchmarks/results/planner/{camp}"
    prof = Profile.load(f"{d}/profile-smollm2-cpu.json")
    cs = cases(sorted(glob.glob(f"{d}/acc-*.json")))
    for factor in (1.0, 1.08):
        W.SimWorker.plan_step = patched(factor)
        rows = [evaluate(prof, c) for c in cs]
        med = {k: statistics.median(r["errors"][k] for r in rows)
               for k in ("ttft_p50", "ttft_p90", "itl_p50")}
        colo = [(r["rate"], {k: round(v, 2) for k, v in r["errors"].items()})
                for r in rows if r["layout"] == "2c"]
        print(camp, factor, {k: f"{v:.0%}" for k, v in med.items()}, "2c:", colo, flush=True)
