"""bench.fuzz in its short form against the real services: no UNKNOWN or INTERNAL, and every service still SERVING."""
import asyncio

from bench import fuzz


def test_generated_requests_get_clear_statuses(stack):
    addresses = {s.name: s.address for s in stack.services}
    result = asyncio.run(fuzz.fuzz(addresses, requests=600, seconds=25, concurrency=8, timeout=10, seed=7))
    assert result["requests"] >= 100, result  # it reached the services, not only itself
    assert result["bad"] == 0, result["bad_examples"]
    assert result["health_after"] == {"gateway": "SERVING", "tokenizer": "SERVING", "worker": "SERVING"}, result
    assert all(s.process.poll() is None for s in stack.services)
