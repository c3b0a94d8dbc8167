"""A Qwen3MoeForCausalLM checkpoint through the real services (gRPC and HTTP), against transformers' greedy output."""
from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from demo.vocab import write_tokenizer_files
from tests.integration.conftest import QWEN3_EOS
from tests.integration.stack import free_port, make_stack
from tests.integration.test_generate import collect
from tests.moe_checkpoints import make_moe_checkpoint
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc

PROMPTS = ["The capital of France is", "你好，世界！今天天气", "Emoji time 🎉🚀", "A mixture of experts #3"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The checkpoint (real Qwen3 vocabulary, a dense layer between two sparse ones), its reference, the stack."""
    path = tmp_path_factory.mktemp("qwen3-moe-tiny-real-vocab")
    write_tokenizer_files(path)
    reference = make_moe_checkpoint(path, vocab_size=151936, num_hidden_layers=3, mlp_only_layers=[1],
                                    num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
                                    eos_token_id=QWEN3_EOS)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    http_port = free_port()
    stack = make_stack(str(path), str(tmp_path_factory.mktemp("moe-logs")), worker_flags=["--max-waiting", "64"],
                       gateway_flags=["--http-port", str(http_port)])
    stack.http_url = f"http://127.0.0.1:{http_port}"
    stack.start()
    yield reference, tokenizer, stack
    stack.stop()


def greedy(reference, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=list(QWEN3_EOS), pad_token_id=151643)
    return out[0, len(prompt_ids):].tolist()


def test_concurrent_grpc_streams_and_http_equal_transformers_greedy(moe):
    reference, tokenizer, stack = moe
    wants = [greedy(reference, tokenizer.encode(p), 12 + i) for i, p in enumerate(PROMPTS)]
    assert any(len(set(w)) > 3 for w in wants)  # a degenerate model would make this test meaningless
    with grpc.insecure_channel(stack.gateway.address) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)

        def run(i: int):
            return collect(gateway.Generate(gateway_pb2.GenerateRequest(prompt=PROMPTS[i], max_tokens=12 + i,
                                                                        temperature=0)))
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched in the worker's steps
            results = list(pool.map(run, range(len(PROMPTS))))
    for (text, ids, _), want in zip(results, wants):
        assert ids == want
        assert text == tokenizer.decode(want, skip_special_tokens=True)
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}).encode()
    request = urllib.request.Request(f"{stack.http_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        completion = json.loads(response.read())
    assert completion["choices"][0]["text"] == tokenizer.decode(wants[0], skip_special_tokens=True)
