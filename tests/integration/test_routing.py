"""Two real workers behind one gateway: prefix groups stay on one worker, a killed worker fails only its streams."""
from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from gateway.fleet.block_hash import prompt_block_hashes
from services.tokenizer.core import TokenizerCore
from tests.integration.stack import Service, free_port, gateway_info, wait_serving, wait_workers_serving
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 16
PREFIX_BLOCKS = 10  # per group; three groups' prefixes (30 blocks) do not fit in one worker's 26
WORKER_BLOCKS = 26
# A stream that runs a while here, leaving room in a worker's cache for a group's prompt beside it.
LONG = 200


@pytest.fixture(scope="module")
def fleet(checkpoint, tmp_path_factory):
    config = json.loads((checkpoint / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * BLOCK_SIZE * 4
    logs = tmp_path_factory.mktemp("routing-logs")
    tok_port, gw_port = free_port(), free_port()
    worker_ports = [free_port(), free_port()]
    common = ["--grace-period", "2"]
    tokenizer = Service("tokenizer", ["services.tokenizer", "--model", str(checkpoint), *common], tok_port,
                        f"{logs}/tokenizer.log")
    workers = [Service(f"worker{i}", ["services.model_worker", "--model", str(checkpoint), "--dtype", "float32",
                                      "--block-size", str(BLOCK_SIZE), "--kv-cache-bytes",
                                      str(WORKER_BLOCKS * block_bytes), *common], port, f"{logs}/worker{i}.log")
               for i, port in enumerate(worker_ports)]
    gateway = Service("gateway", ["gateway", "--tokenizer-addr", f"127.0.0.1:{tok_port}", "--worker-addr",
                                  ",".join(w.address for w in workers), "--health-interval", "0.2",
                                  "--keepalive-time", "1", "--keepalive-timeout", "1", *common],
                      gw_port, f"{logs}/gateway.log")
    services = [tokenizer, *workers, gateway]
    try:
        for service in services:
            service.start()
        for service in services:
            wait_serving(service.address, timeout=120)
        wait_workers_serving(gateway, 2)  # groups spread over both only once the gateway has heard from both
        yield tokenizer, workers, gateway
    finally:
        for service in reversed(services):
            service.stop()


def worker_blocks(worker: Service) -> set[bytes]:
    """The worker's own account of its prefix cache: the snapshot its WatchLoad stream starts with."""
    with grpc.insecure_channel(worker.address) as channel:
        stream = worker_pb2_grpc.ModelWorkerServiceStub(channel).WatchLoad(worker_pb2.WatchLoadRequest(), timeout=5)
        first = next(stream)
        stream.cancel()
    assert first.reset
    return set(first.stored_block_hashes)


def generate(gateway: Service, prompt: str, max_tokens: int, first_token=None) -> grpc.StatusCode:
    with grpc.insecure_channel(gateway.address) as channel:
        stream = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(
            gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0),
            timeout=60)
        try:
            for reply in stream:
                if first_token is not None:
                    first_token.append(reply)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def wait_for(condition, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.1)
    raise TimeoutError(f"no {what} within {timeout} s")


def test_groups_stay_on_one_worker_and_a_dead_workers_streams_go_on_on_the_other(fleet, checkpoint):
    tokenizer, workers, gateway = fleet
    core = TokenizerCore.from_dir(checkpoint)
    prefixes, prefix_hashes = [], []
    for g in range(3):
        text = f"Story {g} starts here." + " once upon a time there was a kingdom" * 30
        ids = core.encode(text)[:PREFIX_BLOCKS * BLOCK_SIZE + 1]
        assert len(ids) > PREFIX_BLOCKS * BLOCK_SIZE
        prefixes.append(core.decode(ids[:-1]))
        prefix_ids = core.encode(prefixes[-1])
        assert core.encode(prefixes[-1] + " Question 0?")[:len(prefix_ids)] == prefix_ids
        prefix_hashes.append(prompt_block_hashes(prefix_ids + [0], BLOCK_SIZE)[:PREFIX_BLOCKS])

    # Three groups, several turns each, three requests at a time.
    with ThreadPoolExecutor(3) as pool:
        for turn in range(4):
            codes = list(pool.map(lambda g: generate(gateway, prefixes[g] + f" Question {turn}?", 4), range(3)))
            assert codes == [grpc.StatusCode.OK] * 3
    held = [worker_blocks(w) for w in workers]
    homes = []
    for g in range(3):
        holders = [i for i in range(2) if set(prefix_hashes[g]) <= held[i]]
        assert len(holders) == 1, f"group {g}'s prefix is cached on workers {holders}"
        homes.append(holders[0])
    assert set(homes) == {0, 1}  # both workers are used
    info = gateway_info(gateway)
    for worker in workers:
        # Each worker computed each of its groups' prefix once: most prompt tokens after that were hits.
        assert info[worker.address].prefix_cache_hit_rate > 0.5, info[worker.address]
        assert info[worker.address].state == "serving"

    # One long stream on each worker; kill one worker while both run.
    firsts = [[], []]
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(generate, gateway, f"Long story number {i}.", LONG, firsts[i]) for i in range(2)]
        wait_for(lambda: all(firsts), what="first tokens")
        in_flight = gateway_info(gateway)
        assert sorted(w.in_flight for w in in_flight.values()) == [1, 1]
        victim, survivor = workers
        victim.stop(signal.SIGKILL)
        # Every request from now on succeeds on the survivor: none may fail while the gateway notices.
        for i in range(6):
            assert generate(gateway, prefixes[i % 3] + " After the crash?", 4) == grpc.StatusCode.OK
        codes = [s.result() for s in streams]
    # The dead worker's stream went on on the survivor, after the tokens it had sent: one whole stream each.
    assert codes == [grpc.StatusCode.OK] * 2
    for i in range(2):
        tokens = [t for reply in firsts[i] for t in reply.token_ids]
        again = []
        assert generate(gateway, f"Long story number {i}.", LONG, again) == grpc.StatusCode.OK
        assert tokens == [t for reply in again for t in reply.token_ids] and len(tokens) == LONG
        assert firsts[i][-1].usage.completion_tokens == LONG  # each token counted once
    info = gateway_info(gateway)
    assert info[victim.address].state == "unreachable" and info[survivor.address].state == "serving"

    # Restarted, it rejoins and takes its share of new prefixes.
    victim.start()
    wait_serving(victim.address, timeout=120)
    wait_for(lambda: gateway_info(gateway)[victim.address].state == "serving", what="rejoin")
    with ThreadPoolExecutor(2) as pool:
        new = [f"Fresh tale {i}." + " the river ran down to the sea" * 6 for i in range(2)]
        assert list(pool.map(lambda p: generate(gateway, p, 8), new)) == [grpc.StatusCode.OK] * 2
    wait_for(lambda: worker_blocks(victim), what="blocks cached on the rejoined worker")
