"""The worker's GenerateMany: many requests on one call, the same tokens as Generate, per-request errors and cancels."""
from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from tests.integration.stack import Service, free_port, make_stack, wait_serving
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2

WAIT_S = 5.0  # a bounded wait on a condition, never a measure of speed


class ManyCall:
    """A GenerateMany call whose starts and cancels are sent as the test goes."""

    def __init__(self, worker, timeout: float = 120):
        self._sent: queue.Queue = queue.Queue()
        self.call = worker.GenerateMany(iter(self._sent.get, None), timeout=timeout)

    def start(self, request_id: str, **fields) -> None:
        work = worker_pb2.GenerateRequest(request_id=request_id, **fields)
        self._sent.put(worker_pb2.GenerateManyRequest(start=work))

    def cancel(self, request_id: str) -> None:
        self._sent.put(worker_pb2.GenerateManyRequest(cancel=request_id))

    def close(self) -> None:
        """Half-close: no more starts or cancels."""
        self._sent.put(None)


def info(worker) -> worker_pb2.GetInfoResponse:
    return worker.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)


def wait_for(worker, done, timeout: float = WAIT_S) -> worker_pb2.GetInfoResponse:
    deadline = time.monotonic() + timeout
    while not done(value := info(worker)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def idle(value: worker_pb2.GetInfoResponse) -> bool:
    return (value.running, value.waiting, value.kv_blocks_used) == (0, 0, 0)


def work(i: int) -> dict:
    """Distinct prompts and lengths, greedy, so each request's tokens are fixed and checkable."""
    return dict(prompt_token_ids=[100 + 7 * i + k for k in range(3 + 2 * i)], max_tokens=6 + 3 * i,
                ignore_eos=True, sampling=worker_pb2.SamplingParams(temperature=0))


def test_one_call_gives_each_request_the_tokens_generate_gives(worker):
    count = 6
    want = [[m.token_id for m in worker.Generate(worker_pb2.GenerateRequest(request_id=f"alone-{i}", **work(i)),
                                                 timeout=60)]
            for i in range(count)]
    assert wait_for(worker, idle).kv_blocks_used == 0

    many = ManyCall(worker)
    for i in range(count):
        many.start(f"r{i}", **work(i))
    many.start("bad", **{**work(0), "sampling": worker_pb2.SamplingParams(temperature=-1)})
    many.start(f"r{count - 1}", **work(0))  # still open: r5 asks for 21 tokens
    many.start("", **work(0))
    many.close()

    got: dict[str, list[worker_pb2.GenerateResponse]] = {}
    errors: dict[str, tuple[int, str]] = {}
    shared_messages = 0
    for response in many.call:  # ends OK once the half-closed call's requests are done
        shared_messages += len({o.request_id for o in response.outputs if not o.error_code}) > 1
        for output in response.outputs:
            if output.error_code:
                assert not output.HasField("step") and output.request_id not in errors
                errors[output.request_id] = (output.error_code, output.error_message)
            else:
                got.setdefault(output.request_id, []).append(output.step)
    assert many.call.code() == grpc.StatusCode.OK
    assert "bad" not in got and "" not in got

    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert errors["bad"][0] == invalid and "temperature" in errors["bad"][1]
    assert errors[f"r{count - 1}"][0] == invalid and "already" in errors[f"r{count - 1}"][1]
    assert errors[""][0] == invalid and "request_id" in errors[""][1]
    assert len(errors) == 3
    # The duplicate's error names the open request's id, which went on to the end untouched.
    assert [[s.token_id for s in got[f"r{i}"]] for i in range(count)] == want
    for i in range(count):
        steps = got[f"r{i}"]
        assert steps[0].prompt_tokens == len(work(i)["prompt_token_ids"])
        assert [s.finish_reason for s in steps[:-1]] == [worker_pb2.FINISH_REASON_UNSPECIFIED] * (len(steps) - 1)
        assert steps[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    assert shared_messages > 0, "no message carried more than one request's step"
    assert idle(wait_for(worker, idle))


def long_work() -> dict:
    return dict(prompt_token_ids=list(range(200, 240)), max_tokens=900, ignore_eos=True)


def first_outputs(many: ManyCall, request_ids: set[str]) -> None:
    """Read the call until each of `request_ids` has produced a token."""
    waiting = set(request_ids)
    for response in many.call:
        for output in response.outputs:
            assert not output.error_code, output.error_message
            waiting.discard(output.request_id)
        if not waiting:
            return


def test_a_cancel_frees_only_its_request_and_the_call_stays_open(worker):
    before = wait_for(worker, idle)
    assert idle(before)
    many = ManyCall(worker)
    many.start("a", **long_work())
    many.start("b", **{**long_work(), "prompt_token_ids": list(range(300, 380))})
    first_outputs(many, {"a", "b"})
    both = info(worker)
    assert both.running == 2 and both.kv_blocks_used > 0

    many.cancel("a")
    one = wait_for(worker, lambda i: i.running == 1)
    assert one.running == 1 and 0 < one.kv_blocks_used < both.kv_blocks_used
    many.cancel("b")
    assert idle(wait_for(worker, idle)), "the cancelled requests still hold KV blocks"

    # The call is still usable after its requests were cancelled.
    many.start("c", **work(1))
    many.close()
    steps = [o for r in many.call for o in r.outputs if o.request_id == "c"]
    assert many.call.code() == grpc.StatusCode.OK
    assert len(steps) == work(1)["max_tokens"] and not any(o.error_code for o in steps)


def test_cancelling_the_call_frees_every_request(worker):
    assert idle(wait_for(worker, idle))
    many = ManyCall(worker)
    for name in "xyz":
        many.start(name, **long_work())
    first_outputs(many, set("xyz"))
    assert info(worker).running == 3
    many.call.cancel()
    many.close()
    assert idle(wait_for(worker, idle)), "a cancelled call left sequences in the worker"


def test_a_per_request_gateway_streams_what_the_multiplexed_one_does(stack, gateway, tmp_path):
    per_request = Service("gateway", ["gateway", "--tokenizer-addr", stack.tokenizer.address, "--worker-addr",
                                      stack.worker.address, "--worker-stream", "per-request"],
                          free_port(), str(tmp_path / "gateway-per-request.log"))
    per_request.start()
    try:
        wait_serving(per_request.address, timeout=60)
        prompts = [f"Stream number {i} says" for i in range(4)]

        def run(stub, i: int) -> tuple[str, list[int]]:
            replies = list(stub.Generate(gateway_pb2.GenerateRequest(prompt=prompts[i], max_tokens=10 + i,
                                                                      temperature=0, ignore_eos=True), timeout=60))
            return "".join(r.text for r in replies), [t for r in replies for t in r.token_ids]

        with grpc.insecure_channel(per_request.address) as channel, ThreadPoolExecutor(4) as pool:
            old = gateway_pb2_grpc.GatewayServiceStub(channel)
            want = list(pool.map(lambda i: run(old, i), range(4)))
            got = list(pool.map(lambda i: run(gateway, i), range(4)))
        assert got == want
        assert [len(ids) for _, ids in got] == [10, 11, 12, 13]
    finally:
        per_request.stop()


def test_a_long_prompts_logprobs_pass_every_hop_in_pieces_beside_a_neighbour(checkpoint, reference_model, reference,
                                                                              tmp_path):
    """With every service at a 16 KiB message limit, 1,000 positions of 20 prompt logprobs (some 230 KB)
    pass the worker's GenerateMany, the tokenizer's DecodeBatches and the public stream in pieces,
    while a neighbour request shares the same calls."""
    import torch

    _, tokenizer = reference
    stack = make_stack(str(checkpoint), str(tmp_path), common_flags=["--max-message-bytes", "16KiB"])
    stack.start()
    try:
        with grpc.insecure_channel(stack.gateway.address) as channel:
            gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
            text = " ".join(["the quick brown fox jumps over the lazy dog"] * 110)
            prompt = tokenizer(text)["input_ids"]
            assert 900 <= len(prompt) <= 1020  # within the checkpoint's 1,024 positions
            long = gateway.Generate(gateway_pb2.GenerateRequest(prompt=text, max_tokens=2, temperature=0,
                                                                prompt_logprobs=20, logprobs=5), timeout=120)
            short_prompt = "Hello there, neighbour"
            short = gateway.Generate(gateway_pb2.GenerateRequest(prompt=short_prompt, max_tokens=8, temperature=0,
                                                                 ignore_eos=True), timeout=120)
            with ThreadPoolExecutor(2) as pool:
                replies, neighbour = pool.map(list, [long, short])
    finally:
        stack.stop()

    assert len(replies) > 3  # pieces, then the two tokens
    assert all(r.ByteSize() <= 16 << 10 for r in replies)
    entries = [e for r in replies for e in r.prompt_logprobs]
    assert [e.token_id for e in entries] == prompt
    with torch.no_grad():
        expected = reference_model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    assert not entries[0].HasField("logprob")
    for position in range(1, len(prompt)):
        row = expected[position - 1]
        assert abs(entries[position].logprob - row[prompt[position]].item()) <= 1e-3
        values, ids = row.topk(20)
        assert [t.token_id for t in entries[position].top][:5] == ids.tolist()[:5]  # the order of near ties may vary
        assert max(abs(t.logprob - v) for t, v in zip(entries[position].top, values.tolist())) <= 1e-3
    greedy, _ = reference
    assert [t for r in replies for t in r.token_ids] == greedy(prompt, 2)
    short_ids = tokenizer(short_prompt)["input_ids"]
    got, expected_ids = [t for r in neighbour for t in r.token_ids], greedy(short_ids, 8)
    assert len(got) == 8 and got[:len(expected_ids)] == expected_ids  # the reference may stop at an eos
