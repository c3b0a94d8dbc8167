"""Prometheus metrics per model worker: state and load read from the fleet at scrape time, routing counters."""
from __future__ import annotations

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from gateway.fleet.workers import SERVING, Fleet

ROUTED = Counter("vllm_v0_gateway_worker_requests", "worker streams opened, by worker", ["worker"])
RETRIED = Counter("vllm_v0_gateway_worker_retries", "requests retried on another worker after this one failed "
                  "UNAVAILABLE before the first token", ["worker"])
# cause: worker (the call to the worker broke: it died or its connection dropped), unavailable (the worker ended
# the request UNAVAILABLE: its engine core is down, or it drains), not_serving (moved off a worker that stopped
# serving), ended (the worker ended the stream without a finish reason), tokenizer (a text stream re-primed on a
# new DecodeBatches call), encode (an Encode retried on another tokenizer).
RESUMED = Counter("vllm_v0_gateway_resumes", "streams carried on after what they were on failed, by cause", ["cause"])

_GAUGES = (
    ("vllm_v0_gateway_worker_up", "1 while the worker serves and is in the rotation", lambda w: w.state == SERVING),
    ("vllm_v0_gateway_worker_running_sequences", "sequences decoding, as the worker reported",
     lambda w: w.load.running),
    ("vllm_v0_gateway_worker_waiting_requests", "requests queued, as the worker reported", lambda w: w.load.waiting),
    ("vllm_v0_gateway_worker_kv_blocks_used", "KV cache blocks in use", lambda w: w.load.kv_blocks_used),
    ("vllm_v0_gateway_worker_kv_blocks_free", "KV cache blocks free", lambda w: w.load.kv_blocks_free),
    ("vllm_v0_gateway_worker_prefix_cache_hit_ratio", "prompt tokens the worker served from its prefix cache, "
     "since it started", lambda w: w.load.prefix_cache_hit_rate),
    ("vllm_v0_gateway_worker_cached_blocks", "prefix-cache blocks the worker holds, from its KV events",
     lambda w: len(w.blocks)),
    ("vllm_v0_gateway_worker_in_flight", "streams this gateway has open on the worker", lambda w: w.in_flight),
)


class FleetCollector:
    """One sample per worker per gauge, read when /metrics is scraped; a removed worker's samples go with it."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet

    def collect(self):
        workers = list(self.fleet.workers.values())
        for name, help_text, read in _GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["worker"])
            for worker in workers:
                family.add_metric([worker.address], float(read(worker)))
            yield family
