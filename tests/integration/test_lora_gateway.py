"""LoRA adapters through the real services: one given at the worker's start, one loaded at runtime through the
gateway's HTTP route; each adapter's greedy output equals transformers + peft in float32."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest
import torch

from tests.integration.conftest import QWEN3_EOS
from tests.integration.stack import free_port, make_stack
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc

PROMPT = "The capital of France is"
MAX_TOKENS = 12
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(checkpoint, path, seed: int, rank: int) -> None:
    """A random PEFT adapter on every linear of the checkpoint (not zero: init_lora_weights=False)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    base = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(path)


def peft_greedy(checkpoint, adapter_path, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy generate with the adapter applied by peft, in float32: the independent reference."""
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM

    base = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_path).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=list(QWEN3_EOS), pad_token_id=151643)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def lora_stack(checkpoint, tmp_path_factory):
    adapters = tmp_path_factory.mktemp("adapters")
    make_adapter(checkpoint, adapters / "sql", seed=1, rank=4)
    make_adapter(checkpoint, adapters / "chat", seed=2, rank=8)
    http_port = free_port()
    stack = make_stack(str(checkpoint), str(tmp_path_factory.mktemp("lora-logs")),
                       worker_flags=["--enable-lora", "--lora-modules", f"sql={adapters / 'sql'}",
                                     "--max-lora-rank", "8"],
                       gateway_flags=["--http-port", str(http_port), "--health-interval", "0.2"])
    stack.http_url = f"http://127.0.0.1:{http_port}"
    stack.adapters = adapters
    stack.start()
    yield stack
    stack.stop()


def grpc_generate(stack, adapter: str) -> tuple[list[int], str]:
    """(token ids, text) of a greedy gRPC Generate of PROMPT with this adapter."""
    with grpc.insecure_channel(stack.gateway.address) as channel:
        replies = list(gateway_pb2_grpc.GatewayServiceStub(channel).Generate(gateway_pb2.GenerateRequest(
            prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, adapter=adapter), timeout=60))
    return [i for reply in replies for i in reply.token_ids], "".join(reply.text for reply in replies)


def test_adapters_from_the_start_and_loaded_at_runtime_equal_peft(lora_stack, checkpoint, reference):
    greedy, tokenizer = reference
    prompt_ids = tokenizer.encode(PROMPT)
    client = openai.OpenAI(base_url=lora_stack.http_url + "/v1", api_key="unused", max_retries=0)
    base_id = client.models.list().data[0].id

    # --lora-modules: listed with its parent, and generating with it over gRPC equals peft's greedy.
    assert [(m.id, getattr(m, "parent", None)) for m in client.models.list().data] == [(base_id, None),
                                                                                      ("sql", base_id)]
    want_sql = peft_greedy(checkpoint, lora_stack.adapters / "sql", prompt_ids)
    assert grpc_generate(lora_stack, "sql")[0] == want_sql
    assert grpc_generate(lora_stack, "")[0] == greedy(prompt_ids, MAX_TOKENS)  # the base model beside it
    assert want_sql != greedy(prompt_ids, MAX_TOKENS)  # the adapter changes the output: the check can fail

    # Loaded at runtime through the gateway, then chosen by `model` on the OpenAI route.
    reply = httpx.post(lora_stack.http_url + "/v1/load_lora_adapter",
                       json={"lora_name": "chat", "lora_path": str(lora_stack.adapters / "chat")}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert [m.id for m in client.models.list().data] == [base_id, "chat", "sql"]
    ids, text = grpc_generate(lora_stack, "chat")
    assert ids == peft_greedy(checkpoint, lora_stack.adapters / "chat", prompt_ids)
    completion = client.completions.create(model="chat", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert completion.model == "chat" and completion.choices[0].text == text

    # A folder that is not an adapter is the worker's 400; unloading makes the name unknown again.
    reply = httpx.post(lora_stack.http_url + "/v1/load_lora_adapter",
                       json={"lora_name": "bad", "lora_path": str(lora_stack.adapters / "missing")}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "BadRequestError", reply.text
    reply = httpx.post(lora_stack.http_url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=60)
    assert reply.status_code == 200, reply.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt=PROMPT, max_tokens=2)
    with pytest.raises(grpc.RpcError) as refused:
        grpc_generate(lora_stack, "chat")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
