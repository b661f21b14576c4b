"""How the router's metrics leave the process: collectors read at scrape time, and the `/metrics` endpoint.

`router.metrics.Metrics` defines and updates the series; this module only exports: `CostGauges` reads the
router's cost model when Prometheus scrapes, `MetricsEndpoint` serves a registry over HTTP, adding a router
replica's label to every sample when it has one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import start_wsgi_server

if TYPE_CHECKING:
    from router.cost_model import CostModel


class CostGauges:
    """The router's cost model as gauges, read at scrape time: what placement decides by, and what a P:D
    planner would size the pools from. Only measured values appear (a worker that left is forgotten)."""

    def __init__(self, model: str, cost: CostModel) -> None:
        self.model, self.cost = model, cost

    def collect(self):
        m = self.cost.measured()
        worker = ["model", "worker"]
        for name, doc, labels, values in (
            ("pdserve_cost_prefill_tokens_per_second", "A prefill worker's measured prefill rate (uncached "
             "prompt tokens per second, EWMA).", worker, m.prefill_tokens_per_s),
            ("pdserve_cost_link_bytes_per_second", "A (prefill, decode) pair's measured KV transfer rate (bytes "
             "per second, EWMA).", ["model", "src", "dst"], m.link_bytes_per_s),
            ("pdserve_cost_decode_step_seconds", "A decode worker's measured step time at the batches it ran "
             "lately (seconds, weighted mean).", worker, m.decode_step_s),
            ("pdserve_cost_decode_step_per_sequence_seconds", "What one more sequence adds to a decode worker's "
             "step (seconds, fitted).", worker, m.decode_step_per_seq_s),
        ):
            family = GaugeMetricFamily(name, doc, labels=labels)
            for key, value in values.items():
                family.add_metric([self.model, *(key if isinstance(key, tuple) else (key,))], value)
            yield family


class _Labelled:
    """A registry whose every sample carries `labels` too (a router replica's, so replicas' series differ)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels

    def collect(self):
        for metric in self.registry.collect():
            metric.samples = [s._replace(labels={**s.labels, **self.labels}) for s in metric.samples]
            yield metric


class MetricsEndpoint:
    """A registry served over HTTP at `/metrics` from a daemon thread (prometheus_client's WSGI server)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int,
                 labels: dict[str, str] | None = None) -> None:
        """Bind `host:port` (port 0: any free port, see `.port`); raises OSError when it cannot. `labels`
        are added to every sample."""
        self._httpd, self._thread = start_wsgi_server(port, host.strip("[]"),
                                                      _Labelled(registry, labels) if labels else registry)
        self.port: int = self._httpd.server_port

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
