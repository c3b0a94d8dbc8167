"""Embeddings and reranking through the real services, against transformers' float32 Qwen3 and Sentence
Transformers on the same checkpoint: a tiny random Qwen3 with the real vocabulary, Qwen3-Embedding's
tokenizer ending (<|endoftext|> after each input) and its Sentence Transformers files."""
from __future__ import annotations

import json
import math

import grpc
import openai
import pytest
import torch
from tokenizers import Tokenizer, processors

from demo.vocab import write_tokenizer_files
from tests.checkpoints import make_checkpoint
from tests.integration.conftest import QWEN3_EOS
from tests.integration.stack import free_port, make_stack
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc

QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
TEXTS = ["The capital of China is Beijing.", "Gravity is a force that attracts two bodies.", "日本語 🎉 mixed"]
# Qwen3-Reranker's model card, as published.
PREFIX = ('<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
          'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def add_sentence_transformers_files(path) -> None:
    """Qwen3-Embedding's pipeline (transformer, last-token pooling, normalisation), its "query" prompt, and its
    tokenizer's post-processor, which ends every input with <|endoftext|>."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "include_prompt": True}))
    (path / "2_Normalize").mkdir()
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"}))
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", 151643)])
    tokenizer.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(transformers' model, its tokenizer, the checkpoint's path, the running stack)."""
    path = tmp_path_factory.mktemp("qwen3-embedding-tiny")
    write_tokenizer_files(path)
    model = make_checkpoint(path, vocab_size=151936, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_id=QWEN3_EOS)
    add_sentence_transformers_files(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    http_port = free_port()
    stack = make_stack(str(path), str(tmp_path_factory.mktemp("embedding-logs")), gateway_flags=[
        "--http-port", str(http_port)])
    stack.http_url = f"http://127.0.0.1:{http_port}"
    stack.start()
    yield model, tokenizer, path, stack
    stack.stop()


@pytest.fixture()
def client(served):
    with openai.OpenAI(base_url=served[3].http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def last_hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a, dtype=torch.float64),
                                                 torch.as_tensor(b, dtype=torch.float64), dim=0).item()


def assert_last_hidden(model, tokenizer, texts: list[str], embeddings: list) -> None:
    """Each embedding is transformers' last-token hidden state of its text, normalised."""
    assert len(embeddings) == len(texts)
    for text, got in zip(texts, embeddings):
        assert cosine(got, last_hidden(model, tokenizer(text)["input_ids"])) >= 0.99999


def test_embeddings_are_transformers_last_token_normalised(served, client):
    model, tokenizer, _, _ = served
    reply = client.embeddings.create(model="", input=TEXTS)
    for text, got in zip(TEXTS, reply.data):
        ids = tokenizer(text)["input_ids"]
        assert ids[-1] == 151643  # the checkpoint's tokenizer ends each input with <|endoftext|>
        want = last_hidden(model, ids)
        assert cosine(got.embedding, want) >= 0.99999
        assert math.isclose(sum(v * v for v in got.embedding), 1.0, abs_tol=1e-5)
    assert reply.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    ids = tokenizer(TEXTS[0])["input_ids"]
    short = client.embeddings.create(model="", input=[ids], dimensions=32, encoding_format="float").data[0]
    assert len(short.embedding) == 32 and cosine(short.embedding, last_hidden(model, ids)[:32]) >= 0.99999


def test_a_named_prompt_gives_what_sentence_transformers_gives(served, client):
    _, _, path, stack = served
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    reference = model.encode(TEXTS[:2], prompt_name="query", convert_to_numpy=True)
    unprompted = model.encode(TEXTS[:2], convert_to_numpy=True)
    assert all(cosine(a.tolist(), b.tolist()) < 0.99 for a, b in zip(reference, unprompted))  # the prompt matters
    got = client.embeddings.create(model="", input=TEXTS[:2], extra_body={"prompt_name": "query"}).data
    for row, want in zip(got, reference):
        assert cosine(row.embedding, want.tolist()) >= 0.99999
    with grpc.insecure_channel(stack.gateway.address) as channel:
        reply = gateway_pb2_grpc.GatewayServiceStub(channel).Embed(gateway_pb2.EmbedRequest(
            inputs=[gateway_pb2.EmbedInput(text=TEXTS[0])], prompt_name="query"), timeout=60)
    assert cosine(reply.embeddings[0].values, reference[0].tolist()) >= 0.99999


def reference_scores(model, tokenizer, query: str, documents: list[str]) -> list[float]:
    """The model card's way: prefix, pair and suffix tokenized apart, sigmoid of yes minus no at the end."""
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    scores = []
    for document in documents:
        pair = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
        ids = (tokenizer.encode(PREFIX, add_special_tokens=False) + tokenizer.encode(pair, add_special_tokens=False)
               + tokenizer.encode(SUFFIX, add_special_tokens=False))
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        scores.append(torch.sigmoid(logits[yes] - logits[no]).item())
    return scores


def test_rerank_scores_are_transformers_sigmoid_of_yes_minus_no(served):
    import httpx

    model, tokenizer, _, stack = served
    query = "What is the capital of China?"
    want = reference_scores(model, tokenizer, query, TEXTS)
    assert max(want) - min(want) > 0.1  # a model whose scores all agree would make the order meaningless
    reply = httpx.post(stack.http_url + "/v1/rerank", json={"query": query, "documents": TEXTS}, timeout=60)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["index"] for r in results] == sorted(range(len(TEXTS)), key=lambda i: -want[i])
    for r in results:
        assert abs(r["relevance_score"] - want[r["index"]]) <= 1e-5
        assert r["document"]["text"] == TEXTS[r["index"]]
    with grpc.insecure_channel(stack.gateway.address) as channel:
        scored = gateway_pb2_grpc.GatewayServiceStub(channel).Score(
            gateway_pb2.ScoreRequest(query=query, documents=TEXTS), timeout=60)
    assert max(abs(a - b) for a, b in zip(scored.scores, want)) <= 1e-5


def served_name(stack) -> str:
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        return c.models.list().data[0].id


def test_langchain_openai_embeddings(served):
    """LangChain's OpenAIEmbeddings, as its docs point it at an OpenAI-compatible server: the texts go as they are
    (check_embedding_ctx_length off; on, it would tokenize them with OpenAI's own vocabulary first)."""
    from langchain_openai import OpenAIEmbeddings

    model, tokenizer, _, stack = served
    embeddings = OpenAIEmbeddings(model=served_name(stack), base_url=stack.http_url + "/v1", api_key="unused",
                                  check_embedding_ctx_length=False, max_retries=0)
    documents = embeddings.embed_documents(TEXTS)
    query = embeddings.embed_query(TEXTS[1])
    assert_last_hidden(model, tokenizer, [*TEXTS, TEXTS[1]], [*documents, query])


def test_llama_index_openai_like_embeddings(served):
    """LlamaIndex's client for OpenAI-compatible embedding servers, documents in a batch and a query."""
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    model, tokenizer, _, stack = served
    embeddings = OpenAILikeEmbedding(model_name=served_name(stack), api_base=stack.http_url + "/v1",
                                     api_key="unused", max_retries=0)
    documents = embeddings.get_text_embedding_batch(TEXTS)
    query = embeddings.get_query_embedding(TEXTS[2])
    assert_last_hidden(model, tokenizer, [*TEXTS, TEXTS[2]], [*documents, query])


def test_cohere_client_rerank(served):
    """Cohere's own client (v2 rerank, at /v2/rerank): indices ranked by the reference scores, cut to top_n."""
    import cohere

    model, tokenizer, _, stack = served
    query = "What is the capital of China?"
    want = reference_scores(model, tokenizer, query, TEXTS)
    client = cohere.ClientV2(api_key="unused", base_url=stack.http_url, timeout=60)
    reply = client.rerank(model=served_name(stack), query=query, documents=TEXTS, top_n=2)
    order = sorted(range(len(TEXTS)), key=lambda i: -want[i])
    assert [r.index for r in reply.results] == order[:2]
    for r in reply.results:
        assert abs(r.relevance_score - want[r.index]) <= 1e-5
