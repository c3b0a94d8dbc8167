"""The worker's Prometheus metrics: engine state read at scrape time, and per-step timings."""
from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.model_worker.core.client import EngineClient

STEP_SECONDS = Histogram("vllm_v0_worker_step_duration_seconds", "one engine step: schedule, forward, sample",
                         buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
GENERATED_TOKENS = Counter("vllm_v0_worker_generated_tokens", "tokens sampled, over all sequences")
# Per request, not per call: one GenerateMany call carries many, which the gRPC call counters cannot see.
REQUESTS = Counter("vllm_v0_worker_requests", "generation requests received, valid or not, by the RPC that "
                   "carried them", ("rpc",))


def observe_step(seconds: float, num_tokens: int) -> None:
    """EngineClient's on_step hook, called as each step's frame arrives from the engine core."""
    STEP_SECONDS.observe(seconds)
    GENERATED_TOKENS.inc(num_tokens)


class EngineCollector:
    """Reads the engine core's latest stats snapshot when /metrics is scraped, so the step loop does no extra work.

    It reads from the HTTP server's thread without a lock: the client replaces the snapshot whole,
    never edits it, so a scrape sees one step's numbers.
    """

    def __init__(self, client: EngineClient):
        self.client = client

    def collect(self):
        stats = self.client.stats
        yield GaugeMetricFamily("vllm_v0_worker_waiting_requests", "requests queued, not yet running",
                                value=stats["waiting"])
        yield GaugeMetricFamily("vllm_v0_worker_running_sequences", "sequences in the running batch",
                                value=stats["running"])
        yield GaugeMetricFamily("vllm_v0_worker_kv_blocks_used", "KV cache blocks held by live sequences (cached "
                                "but unreferenced blocks count as free)", value=stats["kv_blocks_used"])
        yield GaugeMetricFamily("vllm_v0_worker_kv_blocks_total", "KV cache blocks in all",
                                value=stats["kv_blocks_used"] + stats["kv_blocks_free"])
        yield CounterMetricFamily("vllm_v0_worker_prefix_cache_queried_tokens", "prompt tokens looked up in the "
                                  "prefix cache", value=stats["prefix_queries"])
        yield CounterMetricFamily("vllm_v0_worker_prefix_cache_hit_tokens", "prompt tokens found in the prefix "
                                  "cache, whose K/V was reused", value=stats["prefix_hits"])
        yield GaugeMetricFamily("vllm_v0_worker_prefix_cache_hit_ratio", "hit tokens / queried tokens since start",
                                value=stats["prefix_cache_hit_rate"])
        yield CounterMetricFamily("vllm_v0_worker_preemptions", "sequences preempted for lack of KV blocks",
                                  value=stats["preemptions"])
        # Read from the client, not the core's snapshot: it outlives every core it restarts.
        yield CounterMetricFamily("vllm_v0_worker_engine_core_restarts", "engine cores found dead (a failed step, "
                                  "a crash, a hang) and restarted", value=self.client.restarts)
        resume = self.client.resume
        resumed = CounterMetricFamily("vllm_v0_worker_resumes", "open streams carried on after what generated them "
                                      "died (cause engine_core: the worker's engine core), after the tokens they "
                                      "already had", labels=("cause",))
        for cause in {"engine_core", *resume.resumed}:
            resumed.add_metric((cause,), resume.resumed[cause])
        yield resumed
        abandoned = CounterMetricFamily("vllm_v0_worker_resumes_abandoned", "open streams that failed instead of "
                                        "being carried on (reason limit: --max-resumes reached; wait: no engine "
                                        "core ready within --resume-wait)", labels=("reason",))
        for reason in ("limit", "wait"):
            abandoned.add_metric((reason,), resume.abandoned[reason])
        yield abandoned
        method = (self.client.info or {}).get("speculative_method")
        if method:
            proposed = CounterMetricFamily("vllm_v0_worker_spec_proposed_tokens", "speculative decoding: tokens "
                                           "proposed and verified", labels=("method",))
            proposed.add_metric((method,), stats.get("spec_proposed", 0))
            yield proposed
            accepted = CounterMetricFamily("vllm_v0_worker_spec_accepted_tokens", "speculative decoding: proposed "
                                           "tokens the model accepted", labels=("method",))
            accepted.add_metric((method,), stats.get("spec_accepted", 0))
            yield accepted
            rate = GaugeMetricFamily("vllm_v0_worker_spec_acceptance_ratio", "speculative decoding: accepted / "
                                     "proposed tokens since start", labels=("method",))
            rate.add_metric((method,), stats.get("spec_acceptance_rate", 0.0))
            yield rate
