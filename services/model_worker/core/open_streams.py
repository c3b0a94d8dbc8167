"""The engine client's open requests: found by the handle their caller holds and by their id on the serving core,
with what carrying one on to a new core needs (its prompt, its parameters, every token id it has had)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from rpcserver.errors import Unavailable
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.core.protocol import params_to_dict
from services.model_worker.engine.llm_engine import StepOutput


class Sink(Protocol):
    """Where a request's outputs go: each StepOutput, then its end (the one with finish_reason, or an exception).

    Called on the event loop while a step's frame is dispatched, so it must not block; an
    asyncio.Queue is one, and a multiplexed call gathers all its requests' outputs in another.
    """

    def put_nowait(self, item: StepOutput | BaseException) -> None: ...


@dataclass(eq=False, slots=True)
class OpenStream:
    handle: str  # what submit() returned and abort() takes: the same whichever core serves the stream
    request_id: str
    sink: Sink
    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None  # the worker's seed for an unseeded sampled request, so its resumes draw what it would have
    output_ids: list[int]  # the ids it was given at submit, then every token id handed to its sink
    core_id: str | None = None  # its id on the serving core; None while it waits for a new core
    delivered: int = 0  # tokens handed to its sink
    resumes: int = 0  # times carried on to a new core
    adapter: str = ""  # its LoRA adapter's name, kept when it is carried on ("": the base model)

    def add_command(self, core_id: str, resume: bool) -> dict:
        """The add frame that starts it on a core, after the ids it has had. Once it has had a token its
        prompt logprobs have gone out with it, so a resume does not ask for them again."""
        params = self.params
        if self.delivered and params.prompt_logprobs is not None:
            params = replace(params, prompt_logprobs=None)
        command = {"type": "add", "id": core_id, "prompt": self.prompt_ids, "params": params_to_dict(params)}
        if self.output_ids:
            command["output"] = self.output_ids
        if self.seed is not None:
            command["seed"] = self.seed
        if resume:
            command["resume"] = True
        if self.adapter:
            command["adapter"] = self.adapter
        return command


class OpenStreams:
    """Every open request once: by handle, by request id (unique among open ones), and by its id on the core."""

    def __init__(self):
        self._by_handle: dict[str, OpenStream] = {}
        self.on_core: dict[str, OpenStream] = {}  # core id -> stream, for the serving core's outputs
        self._request_ids: set[str] = set()

    def __len__(self) -> int:
        return len(self._by_handle)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._request_ids

    def get(self, handle: str) -> OpenStream | None:
        return self._by_handle.get(handle)

    def add(self, stream: OpenStream) -> None:
        self._by_handle[stream.handle] = stream
        self._request_ids.add(stream.request_id)

    def place(self, stream: OpenStream, core_id: str) -> None:
        """The stream now runs on the serving core under core_id."""
        stream.core_id = core_id
        self.on_core[core_id] = stream

    def end(self, stream: OpenStream) -> None:
        """Forget a stream (ended, failed or cancelled), wherever it was."""
        self._by_handle.pop(stream.handle, None)
        if stream.core_id is not None:
            self.on_core.pop(stream.core_id, None)
        self._request_ids.discard(stream.request_id)

    def off_core(self) -> list[OpenStream]:
        """The core is gone: its streams, in the order they were placed on it, now on no core."""
        streams = list(self.on_core.values())
        self.on_core.clear()
        for stream in streams:
            stream.core_id = None
        return streams

    def waiting(self) -> list[OpenStream]:
        """The streams on no core (waiting for a new one), in the order they were submitted."""
        return [s for s in self._by_handle.values() if s.core_id is None]

    def take_all(self) -> list[OpenStream]:
        """Every open stream, all forgotten."""
        streams = list(self._by_handle.values())
        self._by_handle.clear()
        self.on_core.clear()
        self._request_ids.clear()
        return streams

    def fail(self, streams: list[OpenStream], message: str) -> None:
        """Each stream is forgotten and ends with Unavailable."""
        for stream in streams:
            self.end(stream)
            stream.sink.put_nowait(Unavailable(message))
