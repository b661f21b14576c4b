"""What placement trades, in seconds, learned online from what the workers report: one model, one place.

    prefill(w, n tokens)   = (w's queued prefill tokens + n) / w's prefill rate        [tokens/s, per worker]
    transfer(P -> D, b)    = b / the pair's link rate                                  [bytes/s, per pair]
    admit(D)               = one of D's decode steps, at its batch + 1                 [seconds, per worker]

Every rate is a ratio of exponentially weighted sums (`observe_*`): a prefill's uncached tokens over the
engine time spent on them (its share of the steps that computed it, not the wall time from its first chunk
to its first token, which counts the prompts it shared those steps with); a KV transfer's bytes over its
duration. A decode worker's step time is fitted as a line against the sequences in its batch (so a busier
worker's step is priced as longer before it has run at that batch), and its own prefill rate is what a
prompt chunk adds to the step it rides: that step's time less the fitted decode step at its batch (a step
that carried prompt tokens is never fitted as a decode step). Until a worker or a pair has been measured,
a stand-in counts: for a prefill rate, the mean of the workers measured so far; for a decode step, the
fastest measured worker's at the same batch (a new worker must be chosen to be measured); else a prior (a
pair on one node is assumed faster than one across nodes). Once measured, only measurements count.

These feed `placement.choose_path`: the (prefill, decode) pair with the lowest estimated time until the
request decodes, or the decode worker itself when prefilling there is cheaper and the stall it puts on
that worker's running streams is worth it (see there). A P:D planner would size the pools from the same
numbers, which the router exports as gauges (`pdserve_cost_*`, `router.metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CostPriors:
    """Stand-ins until something is measured (a GPU is far faster; the first observation replaces them), and
    what counts as a measurement."""

    prefill_tokens_per_s: float = 2_000.0
    same_node_bytes_per_s: float = 2e9
    cross_node_bytes_per_s: float = 2e8
    decode_step_s: float = 0.05
    alpha: float = 0.2  # weight of each new prefill and transfer observation
    # weight of each decode step in its worker's fit: steps come tens per second, so this keeps about a
    # second of them on a CPU (0.2 kept five, and one noisy step moved the price of the next placement)
    step_alpha: float = 0.05
    # NOTE: a small transfer's time is the link's latency and per-message costs, not its bandwidth (a 100 KB
    # one measured a fast local link as slower than the prior for a cross-node one): only transfers of at
    # least this many bytes rate a link
    min_rated_transfer_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "same_node_bytes_per_s", "cross_node_bytes_per_s", "decode_step_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("alpha", "step_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass
class _Rate:
    """Amount per second as a ratio of two exponentially weighted sums (each observation's weight decays by
    (1 - alpha) per newer one): a long observation counts for more than a short one, and one noisy small
    one (a 48-token prompt in a step the neighbour slowed) cannot swing it as a mean of rates would."""

    amount: float = 0.0
    seconds: float = 0.0

    def observe(self, amount: float, seconds: float, alpha: float) -> None:
        self.amount = (1 - alpha) * self.amount + amount
        self.seconds = (1 - alpha) * self.seconds + seconds

    @property
    def value(self) -> float | None:
        return self.amount / self.seconds if self.seconds > 0 else None


@dataclass
class _LinearFit:
    """y = a + b*x by exponentially weighted least squares: each observation's weight decays by (1 - alpha)
    per newer one. With too little spread in x to tell a slope (a worker always at one batch size), or a
    negative one (noise: a step does not get faster with more sequences), it is the weighted mean."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, x: float, y: float, alpha: float) -> None:
        keep = 1 - alpha
        self.w, self.sx, self.sy = keep * self.w + 1, keep * self.sx + x, keep * self.sy + y
        self.sxx, self.sxy = keep * self.sxx + x * x, keep * self.sxy + x * y

    @property
    def mean(self) -> float:
        return self.sy / self.w

    @property
    def slope(self) -> float:
        mx = self.sx / self.w
        var = self.sxx / self.w - mx * mx
        if var < 0.25:  # x is a batch size: less spread than this is one size, give or take
            return 0.0
        return max(0.0, (self.sxy / self.w - mx * self.sy / self.w) / var)

    def predict(self, x: float) -> float:
        """(A line through points of a convex curve can dip below zero far left of them: never a time < 0.)"""
        return max(1e-6, self.mean + self.slope * (x - self.sx / self.w))


@dataclass(frozen=True)
class Measured:
    prefill_tokens_per_s: dict[str, float]  # by worker id
    link_bytes_per_s: dict[tuple[str, str], float]  # by (src, dst) worker ids
    decode_step_s: dict[str, float]  # by worker id: at the batch sizes it ran lately (their weighted mean)
    decode_step_per_seq_s: dict[str, float]  # by worker id: what one more sequence adds to a step


@dataclass
class CostModel:
    bytes_per_token: int  # KV bytes one token takes on the wire (every layer, K and V)
    priors: CostPriors = field(default_factory=CostPriors)
    _prefill: dict[str, _Rate] = field(default_factory=dict)  # prompt tokens per second
    _link: dict[tuple[str, str], _Rate] = field(default_factory=dict)  # bytes per second
    _step: dict[str, _LinearFit] = field(default_factory=dict)  # step seconds against running sequences

    # -- observations -----------------------------------------------------------------------------------

    def observe_prefill(self, worker_id: str, num_tokens: int, seconds: float) -> None:
        # NOTE: tiny prompts measure fixed overheads, not throughput: only chunks worth a rate count
        if num_tokens >= 32 and seconds > 0:
            self._prefill.setdefault(worker_id, _Rate()).observe(num_tokens, seconds, self.priors.alpha)

    def observe_transfer(self, src: str, dst: str, num_bytes: int, seconds: float) -> None:
        if num_bytes >= self.priors.min_rated_transfer_bytes and seconds > 0:
            self._link.setdefault((src, dst), _Rate()).observe(num_bytes, seconds, self.priors.alpha)

    def observe_step(self, worker_id: str, seconds: float, num_running: int = 1, num_prefill_tokens: int = 0) -> None:
        """A step of decode worker `worker_id` took `seconds` decoding `num_running` sequences and computing
        `num_prefill_tokens` prompt tokens (a local prefill's chunk)."""
        if seconds <= 0:
            return
        fit = self._step.get(worker_id)
        if num_prefill_tokens:
            # NOTE: the chunk's cost is what it added to a decode step at this batch; before any decode
            # step was seen there is nothing to subtract, and noise can make the difference vanish
            extra = seconds - fit.predict(num_running) if fit is not None and num_running else seconds
            if extra > 0:
                self.observe_prefill(worker_id, num_prefill_tokens, extra)
            return
        fit = fit or _LinearFit()
        fit.observe(num_running, seconds, self.priors.step_alpha)
        self._step[worker_id] = fit  # (inserted once observed: a scrape never sees an empty fit)

    def forget(self, worker_id: str) -> None:
        """A worker left: drop what was learned about it and its links."""
        self._prefill.pop(worker_id, None)
        self._step.pop(worker_id, None)
        for pair in [p for p in self._link if worker_id in p]:
            del self._link[pair]

    # -- rates ------------------------------------------------------------------------------------------

    def prefill_rate(self, worker_id: str) -> float:
        """The worker's measured rate; until it has one, the mean of the workers measured so far (the pools
        run one model on like hardware), and only before any, the prior.

        NOTE: an unmeasured worker must not look faster than measured ones by the prior's optimism alone: the
        router would then send a prompt away from the worker that caches its prefix to a cold one."""
        rate = self._prefill.get(worker_id)
        if rate is not None and rate.value:
            return rate.value
        measured = [e.value for e in self._prefill.values() if e.value]
        return sum(measured) / len(measured) if measured else self.priors.prefill_tokens_per_s

    def link_rate(self, src: str, dst: str, same_node: bool) -> float:
        rate = self._link.get((src, dst))
        if rate is not None and rate.value:
            return rate.value
        return self.priors.same_node_bytes_per_s if same_node else self.priors.cross_node_bytes_per_s

    def step_time(self, worker_id: str, num_running: int | None = None) -> float:
        """The worker's decode step with `num_running` sequences (None: at the batches it ran lately); until
        it has run one, the fastest measured worker's step at that batch, and only before any, the prior.

        NOTE: a new decode worker is priced optimistically, or it may never be measured: a constant prior
        (50 ms against workers measured at 25 ms) or its peers' mean (a slow busy worker in it) left a worker
        just scaled out dearer than a measured fast one, so never chosen. As the fastest peer, it ties with
        that one and takes its share (`placement.choose_path` breaks near ties by load); its first steps
        then price it. (Prefill rates are not optimistic: that would pull prompts off cached prefixes.)"""
        fit = self._step.get(worker_id)
        if fit is not None:
            return fit.mean if num_running is None else fit.predict(num_running)
        fits = list(self._step.values())
        if not fits:
            return self.priors.decode_step_s
        return min(f.mean if num_running is None else f.predict(num_running) for f in fits)

    def measured(self) -> Measured:
        """What has been measured so far (priors and stand-ins left out): the metrics export this.
        NOTE: read from the metrics endpoint's thread while the event loop observes: each dict is copied
        in one builtin call, which the GIL does not interrupt."""
        steps = list(self._step.items())
        return Measured({w: e.value for w, e in list(self._prefill.items()) if e.value},
                        {p: e.value for p, e in list(self._link.items()) if e.value},
                        {w: f.mean for w, f in steps}, {w: f.slope for w, f in steps})

    # -- estimates (seconds) ----------------------------------------------------------------------------

    def prefill_s(self, worker_id: str, queued_tokens: int, num_tokens: int) -> float:
        return (queued_tokens + num_tokens) / self.prefill_rate(worker_id)

    def transfer_s(self, src: str, dst: str, same_node: bool, num_tokens: int) -> float:
        return num_tokens * self.bytes_per_token / self.link_rate(src, dst, same_node)

    def local_budget_tokens(self, worker_id: str) -> int:
        """The longest uncached prompt a decode worker may prefill itself: what it computes in about one of its
        own decode steps (its running streams then see at most one step's extra delay)."""
        return int(self.prefill_rate(worker_id) * self.step_time(worker_id))
