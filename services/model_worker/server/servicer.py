"""ModelWorkerService: requests to engine calls and engine outputs to stream messages."""
from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

from rpcserver.errors import InvalidArgument, Unavailable
from rpcserver.pieces import GRPC_MESSAGE_BYTES, piece_budget
from rpcserver.shared import SAMPLING_FIELDS
from rpcserver.status import grpc_errors
from services.model_worker.config.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutput
from services.model_worker.core.client import EngineClient
from services.model_worker.core.kv_events import LoadDelta
from services.model_worker.engine.pooling import PoolingParams
from services.model_worker.server.metrics import REQUESTS
from services.model_worker.server.multiplex import MultiplexedCall, built_step_messages
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc


# Hashes in one LoadUpdate: 32 bytes each plus 2 of framing, so at most about 1.7 MB a message, well
# inside gRPC's default 4 MiB receive limit. A first snapshot of a large cache (200,000 blocks: 6.8 MB)
# would not fit in one.
MAX_HASHES_PER_UPDATE = 50_000


def load_updates(delta: LoadDelta, block_size: int) -> Iterator[worker_pb2.LoadUpdate]:
    """One delta as LoadUpdates of at most MAX_HASHES_PER_UPDATE hashes each, the load on every one.

    Only the first keeps `reset`: the rest add to what it started, which is what a receiver does
    with the stored hashes of any later message.
    """
    hashes = [(h, True) for h in delta.stored] + [(h, False) for h in delta.evicted]
    for start in range(0, max(len(hashes), 1), MAX_HASHES_PER_UPDATE):
        piece = hashes[start:start + MAX_HASHES_PER_UPDATE]
        yield worker_pb2.LoadUpdate(reset=delta.reset and start == 0, block_size=block_size,
                                    stored_block_hashes=[h for h, stored in piece if stored],
                                    evicted_block_hashes=[h for h, stored in piece if not stored], **delta.load)


def structured_output(message: worker_pb2.StructuredOutput) -> StructuredOutput | None:
    """The proto's oneof as the engine's constraint; None when no form is set (or json_object is false)."""
    kind = message.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not message.json_object):
        return None
    if kind == "json_object":
        constraint = StructuredOutput("json_object")
    elif kind == "choice":
        constraint = StructuredOutput.choice(list(message.choice.choices))
    else:
        constraint = StructuredOutput(kind, getattr(message, kind))
    if message.HasField("start_after_token_id"):  # the constraint is frozen: a copy that waits for the token
        constraint = dataclasses.replace(constraint, start_after=message.start_after_token_id)
    return constraint


class ModelWorkerServicer(worker_pb2_grpc.ModelWorkerServiceServicer):
    def __init__(self, model_name: str, engine: EngineClient | None = None,
                 max_message_bytes: int = GRPC_MESSAGE_BYTES):
        # Registered before the server starts; the engine arrives once the checkpoint is found.
        self._engine = engine
        self.model_name = model_name
        self.max_message_bytes = max_message_bytes  # the server's send limit, which no stream message may pass

    @property
    def engine(self) -> EngineClient:
        if self._engine is None:
            raise Unavailable("the model is still loading; retry shortly")
        return self._engine

    @engine.setter
    def engine(self, engine: EngineClient) -> None:
        self._engine = engine

    def _params(self, request: worker_pb2.GenerateRequest) -> SamplingParams:
        overrides = {f: getattr(request.sampling, f) for f in SAMPLING_FIELDS if request.sampling.HasField(f)}
        if request.HasField("max_tokens"):
            overrides["max_tokens"] = request.max_tokens
        if request.HasField("logprobs"):
            overrides["logprobs"] = request.logprobs
        if request.HasField("prompt_logprobs"):
            overrides["prompt_logprobs"] = request.prompt_logprobs
        overrides["logit_bias"] = tuple(sorted(request.logit_bias.items()))
        overrides["stop_token_ids"] = tuple(request.stop_token_ids)
        overrides["ignore_eos"] = request.ignore_eos
        overrides["structured_output"] = structured_output(request.structured_output)
        return self.engine.make_params(overrides)

    @grpc_errors
    async def Generate(self, request: worker_pb2.GenerateRequest, context):
        REQUESTS.labels("Generate").inc()
        params = self._params(request)
        request_id = request.request_id or uuid.uuid4().hex
        first = True
        async for out in self.engine.generate(request_id, list(request.prompt_token_ids), params,
                                              output_ids=list(request.output_token_ids), adapter=request.adapter):
            # Many prompt logprobs are built on a thread, so the loop serves the other calls meanwhile.
            for message in await built_step_messages(out, first, piece_budget(self.max_message_bytes)):
                yield message
            first = False

    @grpc_errors
    async def GenerateMany(self, requests, context):
        # Each request's errors are outputs on the call; only an unreadable message ends it early.
        async for response in MultiplexedCall(lambda: self.engine, self._params, self.max_message_bytes).serve(requests):
            yield response

    @grpc_errors
    async def Embed(self, request: worker_pb2.EmbedRequest, context) -> worker_pb2.EmbedResponse:
        REQUESTS.labels("Embed").inc()
        pooling = PoolingParams.embed(request.dimensions if request.HasField("dimensions") else None)
        outputs = await self.engine.pool(request.request_id or uuid.uuid4().hex,
                                         [list(i.token_ids) for i in request.inputs], pooling, request.adapter)
        return worker_pb2.EmbedResponse(embeddings=[worker_pb2.Embedding(values=o.values) for o in outputs],
                                        prompt_tokens=sum(o.prompt_tokens for o in outputs))

    @grpc_errors
    async def Score(self, request: worker_pb2.ScoreRequest, context) -> worker_pb2.ScoreResponse:
        REQUESTS.labels("Score").inc()
        pooling = PoolingParams.score(request.token_ids)
        outputs = await self.engine.pool(request.request_id or uuid.uuid4().hex,
                                         [list(i.token_ids) for i in request.inputs], pooling, request.adapter)
        return worker_pb2.ScoreResponse(results=[worker_pb2.TokenLogits(logits=o.values) for o in outputs],
                                        prompt_tokens=sum(o.prompt_tokens for o in outputs))

    @grpc_errors
    async def LoadAdapter(self, request: worker_pb2.LoadAdapterRequest, context) -> worker_pb2.LoadAdapterResponse:
        REQUESTS.labels("LoadAdapter").inc()
        if request.name == self.model_name:
            raise InvalidArgument(f"{request.name!r} is the base model's name; give the adapter another")
        info = await self.engine.load_adapter(request.name, request.path)
        return worker_pb2.LoadAdapterResponse(adapter=worker_pb2.AdapterInfo(**info))

    @grpc_errors
    async def UnloadAdapter(self, request: worker_pb2.UnloadAdapterRequest,
                            context) -> worker_pb2.UnloadAdapterResponse:
        REQUESTS.labels("UnloadAdapter").inc()
        await self.engine.unload_adapter(request.name)
        return worker_pb2.UnloadAdapterResponse()

    @grpc_errors
    async def WatchLoad(self, request, context):
        engine = self.engine
        watcher = engine.load_feed.watch()
        try:
            while (delta := await watcher.next()) is not None:
                block_size = engine.info["block_size"] if engine.info else 0
                for update in load_updates(delta, block_size):
                    yield update
        finally:
            watcher.close()

    @grpc_errors
    async def GetInfo(self, request, context) -> worker_pb2.GetInfoResponse:
        engine = self.engine
        info, stats = engine.info, engine.stats
        if info is None:
            raise Unavailable("the model is still loading; retry shortly")
        return worker_pb2.GetInfoResponse(
            model=self.model_name, dtype=info["dtype"], device=info["device"], max_context=info["max_model_len"],
            vocab_size=info["vocab_size"], eos_token_ids=info["eos_token_ids"], running=stats["running"],
            waiting=stats["waiting"], kv_blocks_used=stats["kv_blocks_used"], kv_blocks_free=stats["kv_blocks_free"],
            block_size=info["block_size"], prefix_cache_hit_rate=stats["prefix_cache_hit_rate"],
            tokens_after_cancel=engine.tokens_after_cancel, max_logprobs=MAX_LOGPROBS,
            speculative_method=info.get("speculative_method", ""),
            speculative_proposed_tokens=stats.get("spec_proposed", 0),
            speculative_accepted_tokens=stats.get("spec_accepted", 0),
            speculative_acceptance_rate=stats.get("spec_acceptance_rate", 0.0),
            adapters=[worker_pb2.AdapterInfo(**a) for a in engine.adapters.values()],
            hidden_size=engine.model_config.hidden_size, embeddings_only=not info.get("has_lm_head", True),
            runner=engine.config.runner)

