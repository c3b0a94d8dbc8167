"""Grammars compiling beside the step loop: a constrained request joins the batch once its matcher is ready."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from rpcserver.errors import InvalidArgument, ResourceExhausted, ServiceError
from services.model_worker.engine.sequence import Sequence
from services.model_worker.executor.grammar import GrammarEngine

log = logging.getLogger(__name__)


class GrammarCompiles:
    """The sequences whose grammar compiles on the grammar engine's compile threads, while the core steps the rest.

    A compile is started when its request is added and collected between steps (take_settled). `wake` is
    called on the compile thread as one ends, so that a core with nothing to step stops waiting for commands.
    A compile cannot be stopped once it runs: past its time limit its request fails and its result is dropped.
    """

    def __init__(self, grammar: GrammarEngine, timeout_s: float, wake: Callable[[], None]):
        self.grammar = grammar
        self.timeout_s = timeout_s
        self.wake = wake
        self._pending: dict[str, tuple[Sequence, Future, float]] = {}  # request id -> (sequence, compile, added at)

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def submit(self, seq: Sequence) -> None:
        # A resumed request's matcher replays its outputs on the compile thread too.
        future = self.grammar.compile_pool.submit(self.grammar.matcher, seq.params.structured_output,
                                                  list(seq.output_ids))
        self._pending[seq.request_id] = (seq, future, time.monotonic())
        future.add_done_callback(lambda _: self.wake())

    def discard(self, request_id: str) -> bool:
        """Forget a request (aborted); False if none was compiling."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return False
        entry[1].cancel()  # frees its place in the pool if it has not started
        return True

    def take_settled(self) -> tuple[list[Sequence], list[tuple[str, ServiceError]]]:
        """The sequences whose matcher is ready, in the order they were added, and the requests whose compile
        failed or ran past the time limit, each with its error."""
        ready, failed = [], []
        now = time.monotonic()
        for request_id, (seq, future, added) in list(self._pending.items()):
            kind = seq.params.structured_output.kind
            if future.done():
                del self._pending[request_id]
                try:
                    seq.grammar = future.result()
                except ServiceError as e:
                    failed.append((request_id, e))
                except Exception as e:  # noqa: BLE001 - whatever a grammar brings fails its request alone
                    log.warning("request %s: its structured_output %s did not compile", request_id, kind,
                                exc_info=True)
                    failed.append((request_id, InvalidArgument(
                        f"structured_output {kind} could not be compiled: {type(e).__name__}: {e}")))
                else:
                    ready.append(seq)
            elif now >= self._deadline(added):
                del self._pending[request_id]
                future.cancel()
                failed.append((request_id, ResourceExhausted(
                    f"structured_output {kind} did not compile within {self.timeout_s:g} s; simplify it")))
        return ready, failed

    def seconds_until_due(self) -> float | None:
        """How long a core with nothing to step may wait before a compile's time limit needs checking; None: none."""
        if not self._pending:
            return None
        return max(min(self._deadline(added) for _, _, added in self._pending.values()) - time.monotonic(), 0.0)

    def _deadline(self, added: float) -> float:
        # The time limit runs from when the tokenizer is ready, at the earliest: loading it (~1.5 s, once,
        # on the first constrained request) is no fault of the grammar. Until then this is only when to look again.
        loaded = self.grammar.tokenizer_loaded_at
        return max(added, loaded if loaded is not None else time.monotonic()) + self.timeout_s
