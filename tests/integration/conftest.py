"""Fixtures: a tiny random Qwen3 with the real Qwen3 vocabulary, the three services, and the reference."""
from __future__ import annotations

import os
import pathlib

import grpc
import pytest
import torch

from demo.vocab import write_tokenizer_files
from tests.checkpoints import make_checkpoint
from tests.integration.stack import free_port, make_stack
from vllm_v0.gateway.v1 import gateway_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2_grpc

QWEN3_EOS = (151645, 151643)


@pytest.fixture(scope="session", autouse=True)
def built_kernels():
    """Every C kernel compiled into the cache before the first service starts. A worker compiles the ones it
    lacks at start, for tens of seconds on both CPUs: inside a test that watches event-loop stalls or
    pauses, that compile would be what it measured."""
    from concurrent.futures import ThreadPoolExecutor

    from services.model_worker.kernels import build

    sources = sorted(pathlib.Path(build.__file__).parent.glob("*.c"))
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for source, error in zip(sources, pool.map(_try_build, sources)):
            if error:  # the worker falls back to PyTorch there, as the tests of that kernel say
                print(f"{source.name}: {error}")


def _try_build(source) -> str:
    from services.model_worker.kernels import build

    try:
        build.build(source)
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-tiny-real-vocab")
    write_tokenizer_files(path)
    make_checkpoint(path, vocab_size=151936, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_id=QWEN3_EOS)
    return path


@pytest.fixture(scope="session")
def reference_model(checkpoint):
    """transformers' Qwen3 on the same files, in float32: the independent reference."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def reference(reference_model, checkpoint):
    """transformers' greedy generate and tokenizer on the same files: the independent reference."""
    from transformers import AutoTokenizer

    model = reference_model
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    def greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=list(QWEN3_EOS), pad_token_id=151643)
        return out[0, len(prompt_ids):].tolist()

    return greedy, tokenizer


@pytest.fixture(scope="session")
def stack(checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    http_port = free_port()
    stack = make_stack(str(checkpoint), str(logs), worker_flags=["--max-waiting", "64"],
                       gateway_flags=["--http-port", str(http_port)])
    stack.http_url = f"http://127.0.0.1:{http_port}"
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture()
def gateway(stack):
    with grpc.insecure_channel(stack.gateway.address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


@pytest.fixture()
def worker(stack):
    with grpc.insecure_channel(stack.worker.address) as channel:
        yield worker_pb2_grpc.ModelWorkerServiceStub(channel)
