"""GET /metrics: Prometheus text format (prometheus-client), one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..decode.result import GenerationResult
from ..runtime.parallel import slot_rows

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Counters over the server's life; gauges read the service when scraped."""

    def __init__(self, service, recovery=None, slots=None):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pipeinfer_requests", "Requests answered, by endpoint and outcome "
                                "(stop, length, cancelled, error, rejected)", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("pipeinfer_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("pipeinfer_generated_tokens", "Tokens generated", registry=r)
        self.draft_tokens = Counter("pipeinfer_draft_tokens", "Draft tokens whose verification completed", registry=r)
        self.accepted_tokens = Counter("pipeinfer_draft_accepted_tokens", "Draft tokens accepted", registry=r)
        self.runs_launched = Counter("pipeinfer_runs_launched", "Pipeline runs launched", registry=r)
        self.runs_cancelled = Counter("pipeinfer_runs_cancelled", "Pipeline runs cancelled (rejected drafts, "
                                      "or in flight when a text ended)", registry=r)
        self.ttft = Histogram("pipeinfer_time_to_first_token_seconds", "From the start of prompt processing to the "
                              "first token (queue time not included)", buckets=TTFT_BUCKETS, registry=r)
        self.queue_wait = Histogram("pipeinfer_queue_wait_seconds", "Time requests waited in the queue",
                                    buckets=TTFT_BUCKETS, registry=r)
        self.kv_cells = Gauge("pipeinfer_kv_cells_used", "KV cells in use on each rank at the end of the last "
                              "request (before the caches are cleared for the next one)", ["rank"], registry=r)
        Gauge("pipeinfer_queue_depth", "Requests waiting behind the ones being generated",
              registry=r).set_function(service.queue_depth)
        Gauge("pipeinfer_requests_running", "Requests being generated (at most --parallel)",
              registry=r).set_function(service.n_running)
        r.register(_SlotCollector(service, slots))
        Gauge("pipeinfer_ready", "1 once the models are loaded and the service answers",
              registry=r).set_function(lambda: int(service.status == "ok"))
        stats = (lambda: recovery() if recovery is not None else None)
        Gauge("pipeinfer_restarts", "Times the job was started again after a lost rank, host or link",
              registry=r).set_function(lambda: getattr(stats(), "restarts", 0))
        Gauge("pipeinfer_resumed_requests", "Requests resumed from their committed tokens on a new job",
              registry=r).set_function(lambda: getattr(stats(), "resumed_requests", 0))
        Gauge("pipeinfer_seconds_without_pipeline", "Seconds the server has had no job to run requests on, "
              "after losing one", registry=r).set_function(
            lambda: stats().without_pipeline_s() if stats() is not None else 0.0)
        Gauge("pipeinfer_hosts_lost", "Hosts of the hostfile the job no longer runs on",
              registry=r).set_function(lambda: len(getattr(stats(), "hosts_lost", []) or []))

    def finished(self, endpoint: str, result: GenerationResult) -> None:
        self.requests.labels(endpoint, result.finish_reason or "stop").inc()
        self.prompt_tokens.inc(result.n_prompt)
        self.generated_tokens.inc(result.n_gen)
        self.draft_tokens.inc(result.acceptance.drafted)
        self.accepted_tokens.inc(result.acceptance.accepted)
        self.runs_launched.inc(result.runs.launched)
        self.runs_cancelled.inc(result.runs.cancelled)
        if result.ttft_s is not None:
            self.ttft.observe(result.ttft_s)
        if result.queue_s is not None:
            self.queue_wait.observe(result.queue_s)
        for rank, cells in result.kv_used_cells().items():
            self.kv_cells.labels(rank).set(cells)

    def refused(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SlotCollector:
    """Per-slot gauges, read from the service when scraped (GET /slots has the same)."""

    def __init__(self, service, slots=None):
        self.service, self.slots = service, slots

    def collect(self):
        busy = GaugeMetricFamily("pipeinfer_slot_processing", "1 while the slot generates a request", labels=["slot"])
        decoded = GaugeMetricFamily("pipeinfer_slot_decoded_tokens", "Tokens the slot's request has generated so far",
                                    labels=["slot"])
        if self.service.cfg is not None:
            for row in (self.slots() if self.slots is not None else slot_rows(self.service)):
                busy.add_metric([str(row["id"])], int(row["is_processing"]))
                decoded.add_metric([str(row["id"])], row.get("n_decoded", 0))
        yield busy
        yield decoded
