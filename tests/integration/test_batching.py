"""Many streams at once through the real services: each gets its own text, and a full queue refuses at once."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.integration.stack import make_stack
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2

WORDS = ["river", "中文", "lantern", "🎉", "quantum", "mañana", "gravel", "東京"]


def collect(stub, request) -> tuple[str, list[int], gateway_pb2.GenerateResponse]:
    text, ids, last = "", [], None
    for message in stub.Generate(request):
        text += message.text
        ids += message.token_ids
        last = message
    return text, ids, last


def test_32_concurrent_streams_each_get_their_own_text(stack, reference, worker):
    greedy, tokenizer = reference
    prompts = [f"Stream {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 5)) for i in range(32)]
    max_tokens = [4 + (5 * i) % 13 for i in range(32)]
    want = [greedy(tokenizer.encode(p), n) for p, n in zip(prompts, max_tokens)]
    assert len({tuple(w) for w in want}) == 32

    done = threading.Event()
    most_running = 0

    def watch():
        nonlocal most_running
        while not done.is_set():
            most_running = max(most_running, worker.GetInfo(worker_pb2.GetInfoRequest()).running)
            done.wait(0.005)

    with grpc.insecure_channel(stack.gateway.address) as channel, ThreadPoolExecutor(33) as pool:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        watcher = pool.submit(watch)
        futures = [pool.submit(collect, stub, gateway_pb2.GenerateRequest(prompt=p, max_tokens=n, temperature=0))
                   for p, n in zip(prompts, max_tokens)]
        results = [f.result(timeout=300) for f in futures]
        done.set()
        watcher.result()
    for (text, ids, last), want_ids in zip(results, want):
        assert ids == want_ids
        assert text == tokenizer.decode(want_ids, skip_special_tokens=True)
        assert last.usage.completion_tokens == len(want_ids)
    assert most_running > 1  # they really shared steps
    info = worker.GetInfo(worker_pb2.GetInfoRequest())
    assert (info.running, info.waiting) == (0, 0)
    assert info.kv_blocks_used == 0


@pytest.fixture(scope="module")
def small_queue_stack(checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs-small-queue")
    stack = make_stack(str(checkpoint), str(logs), worker_flags=["--max-num-seqs", "2", "--max-waiting", "2"])
    stack.start()
    yield stack
    stack.stop()


def test_burst_beyond_the_queue_is_refused_at_once(small_queue_stack):
    long_tokens, burst = 600, 8
    with grpc.insecure_channel(small_queue_stack.gateway.address) as channel, ThreadPoolExecutor(2 + burst) as pool:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        started = [threading.Event() for _ in range(2)]
        finished = [threading.Event() for _ in range(2)]

        def long_stream(i: int) -> int:
            count = 0
            for message in stub.Generate(gateway_pb2.GenerateRequest(
                    prompt=f"long {i}", max_tokens=long_tokens, ignore_eos=True, temperature=0)):
                count += len(message.token_ids)
                started[i].set()
            finished[i].set()
            return count

        def short_stream(i: int):
            try:
                return collect(stub, gateway_pb2.GenerateRequest(prompt=f"burst {i}", max_tokens=4, ignore_eos=True,
                                                                 temperature=0))
            except grpc.RpcError as e:
                # Refused while both long streams still hold the worker's two running slots.
                return e.code(), e.details(), any(f.is_set() for f in finished)

        longs = [pool.submit(long_stream, i) for i in range(2)]
        for event in started:
            assert event.wait(120)
        shorts = [f.result(timeout=300) for f in [pool.submit(short_stream, i) for i in range(burst)]]
        assert [f.result(timeout=300) for f in longs] == [long_tokens] * 2

    refused = [r for r in shorts if isinstance(r[0], grpc.StatusCode)]
    served = [r for r in shorts if not isinstance(r[0], grpc.StatusCode)]
    assert len(refused) == burst - 2
    for code, details, after_a_long_one_finished in refused:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in details
        assert not after_a_long_one_finished
    for text, ids, last in served:
        assert len(ids) == 4 and last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
