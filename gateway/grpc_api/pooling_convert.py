"""The public EmbedRequest and ScoreRequest protos as the cores' requests, and their results as replies."""
from __future__ import annotations

from gateway.core.embedding import EmbeddingRequest, Embeddings
from gateway.core.scoring import ScoringRequest, Scores
from vllm_v0.gateway.v1 import gateway_pb2


def embedding_request(msg: gateway_pb2.EmbedRequest) -> EmbeddingRequest:
    """Copies the fields across; an input with token ids is taken as ids, else as its text."""
    return EmbeddingRequest(
        inputs=[item.token_ids if len(item.token_ids) else item.text for item in msg.inputs],
        dimensions=msg.dimensions if msg.HasField("dimensions") else None,
        prompt_name=msg.prompt_name, adapter=msg.adapter, request_id=msg.request_id)


def embed_reply(result: Embeddings, request_id: str) -> gateway_pb2.EmbedResponse:
    return gateway_pb2.EmbedResponse(embeddings=[gateway_pb2.Embedding(values=v) for v in result.vectors],
                                     usage=gateway_pb2.Usage(prompt_tokens=result.prompt_tokens),
                                     request_id=request_id)


def scoring_request(msg: gateway_pb2.ScoreRequest) -> ScoringRequest:
    """Every document paired with the query."""
    return ScoringRequest(pairs=[(msg.query, document) for document in msg.documents],
                          instruction=msg.instruction if msg.HasField("instruction") else None,
                          adapter=msg.adapter, request_id=msg.request_id)


def score_reply(result: Scores, request_id: str) -> gateway_pb2.ScoreResponse:
    return gateway_pb2.ScoreResponse(scores=result.scores, usage=gateway_pb2.Usage(prompt_tokens=result.prompt_tokens),
                                     request_id=request_id)
