"""Fleet sizing: profile a deployment, simulate pdserve on a trace, and plan the (P, D) pools for an SLO.

    profile.py    the measured constants (one versioned JSON file: machine, model, date)
    trace.py      the requests to simulate: bench workloads at a rate, or a .jsonl trace
    workers.py    a simulated worker: its engine steps, fair prompt order, continuous batching
    simulator.py  the discrete-event simulation: router placement (router.placement, router.cost_model)
    results.py    what a simulation predicts: TTFT/ITL percentiles, SLO attainment, goodput, utilisation
    sizing.py     the cheapest layout that meets an SLO (`pdserve plan size`)
    profiler.py   measures a running deployment into a profile (`pdserve plan profile`)
    cli.py        `pdserve plan ...`

Like the router and the control plane, nothing here loads torch (an import-linter contract).
"""
