"""What the gateway records of each Generate call: Prometheus metrics and one log line."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter, Histogram

log = logging.getLogger("gateway.requests")

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TIME_TO_FIRST_TOKEN = Histogram("vllm_v0_gateway_time_to_first_token_seconds",
                                "from a Generate call's arrival to its first token", buckets=_LATENCY_BUCKETS)
TIME_PER_OUTPUT_TOKEN = Histogram("vllm_v0_gateway_time_per_output_token_seconds",
                                  "a request's mean time between tokens after the first",
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
PROMPT_TOKENS = Counter("vllm_v0_gateway_prompt_tokens", "prompt tokens of Generate calls, counted once tokenized")
COMPLETION_TOKENS = Counter("vllm_v0_gateway_completion_tokens", "tokens streamed back to clients")
FINISHED = Counter("vllm_v0_gateway_requests_finished", "Generate calls by how they ended: eos, length, stop, "
                   "or error (any non-OK status)", ["finish_reason"])


@dataclass
class RequestRecord:
    """Facts about one Generate call, filled in as it runs; `done()` logs and counts them once."""
    request_id: str  # the caller's (checked) or a generated one: logged and echoed back
    prompt: object = None  # the prompt text or chat messages, kept only with --log-prompts
    worker_request_id: str = ""  # the gateway's own id for it on the worker, once sent there
    arrival: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str = ""  # eos, length or stop once finished
    # Speculative decoding on the worker: steps that verified proposals for this request, and the proposals
    # they accepted (GenerateResponse.spec_accepted).
    spec_steps: int = 0
    spec_accepted: int = 0

    def add_tokens(self, count: int = 1) -> None:
        """`count` tokens came now (several when they came faster than a message per token went out)."""
        now = time.perf_counter()
        self.completion_tokens += count
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now

    @property
    def ttft(self) -> float | None:
        return self.first_token_at - self.arrival if self.first_token_at is not None else None

    def done(self, code: grpc.StatusCode, error: BaseException | None = None) -> None:
        self._count(code)
        ttft = self.ttft
        line = (f"request {self.request_id}: {code.name}, finish {self.finish_reason or '-'}, "
                f"prompt {self.prompt_tokens} tokens, completion {self.completion_tokens} tokens, "
                f"ttft {f'{ttft:.3f} s' if ttft is not None else '-'}, "
                f"total {time.perf_counter() - self.arrival:.3f} s")
        if self.spec_steps:
            line += (f", speculative: mean accepted length {self.spec_accepted / self.spec_steps:.2f} over "
                     f"{self.spec_steps} verifications")
        if self.worker_request_id:
            line += f", worker request {self.worker_request_id}"
        if code != grpc.StatusCode.OK and error is not None:
            line += f", why {_reason(error)!r}"  # repr keeps it on one line
        if self.prompt is not None:
            line += f", prompt text {self.prompt!r}"
        log.info("%s", line)

    def _count(self, code: grpc.StatusCode) -> None:
        PROMPT_TOKENS.inc(self.prompt_tokens)
        COMPLETION_TOKENS.inc(self.completion_tokens)
        FINISHED.labels(self.finish_reason if code == grpc.StatusCode.OK else "error").inc()
        if self.first_token_at is not None:
            TIME_TO_FIRST_TOKEN.observe(self.first_token_at - self.arrival)
            if self.completion_tokens > 1:
                TIME_PER_OUTPUT_TOKEN.observe((self.last_token_at - self.first_token_at) / (self.completion_tokens - 1))


def _reason(error: BaseException) -> str:
    """What the client was told, as far as the log should say it."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.details() or error.code().name  # a downstream service's status, passed on
    return str(error) or type(error).__name__
