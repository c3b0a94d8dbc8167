"""python -m services.model_worker.core.engine_core: the process whose main thread loads the model and runs the step loop.

The worker starts it with one end of a socket pair; everything it learns and says crosses that
socket as frames (see protocol.py). Stepping on this process's main thread, with nothing else computing
here, keeps torch to one OpenMP team, which decodes faster than stepping on a side thread.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence

import torch

from rpcserver import collector
from rpcserver.errors import InvalidArgument, ServiceError, Unavailable
from rpcserver.server import setup_logging
from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.model import ConfigError
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.core import protocol
from services.model_worker.core.grammar_compiles import GrammarCompiles
from services.model_worker.core.stats_log import StatsLog
from services.model_worker.engine.llm_engine import LLMEngine, StepOutput
from services.model_worker.engine.pooling import PoolingOutput
from services.model_worker.host import cpu_affinity
from services.model_worker.model.loader import LoadError

log = logging.getLogger("engine_core")

# Put in the command queue when a grammar has compiled, so that an idle core looks at once.
_WAKE = object()


class EngineDeadError(Exception):
    """A step failed inside the model's forward or the sampler: the one failure that ends the core.

    Whatever a request brings (its parameters, its grammar, any exception while it is added or its grammar
    compiles) fails that request alone, and the core serves on.

    The device may be poisoned (after a CUDA illegal address or launch failure every later step
    fails too), so the core ends and the worker starts a fresh one, as vLLM v1's EngineDeadError.
    """


class EngineCore:
    """Owns the engine; commands come in from a queue and one update frame goes out per step.

    Commands are applied between steps, so a sequence joins or leaves at any step boundary. A request with
    structured output joins once its grammar has compiled on a thread of its own (GrammarCompiles), so the
    running sequences keep stepping meanwhile.
    """

    def __init__(self, engine: LLMEngine, send: Callable[[dict], None], stats_interval_s: float = 10.0):
        self.engine = engine
        self.send = send
        self.stats_log = StatsLog(engine, stats_interval_s)
        self.live: set[str] = set()  # requests added and neither finished nor aborted
        self.adds_applied = 0  # lets the worker count adds still in flight, for its exact queue limit
        self.steps = 0
        self.errors: list[list] = []  # for the next update frame
        self.adapter_replies: list[list] = []  # [command id, error kind ("": done), message, info], for the next frame
        self.compiles = GrammarCompiles(engine.grammar, engine.engine_config.grammar_compile_timeout_s, self._wake)
        self._commands: queue.SimpleQueue | None = None

    def run(self, commands: queue.SimpleQueue) -> None:
        """Until a shutdown command or the end of the socket (None in the queue)."""
        self._commands = commands
        while True:
            batch = self._take(commands)
            for command in batch:
                if command is _WAKE:
                    continue
                if isinstance(command, BaseException):
                    raise command  # the reader thread failed
                if command is None or command["type"] == "shutdown":
                    return
                self._apply(command)
            self._admit_compiled()
            if self.engine.has_work():
                self._step()
            elif batch or self.errors:
                self._send_update([], None)  # e.g. aborts that emptied the engine: the worker's stats must say so

    def stats(self) -> dict:
        blocks = self.engine.block_manager
        stats = self.engine.stats()
        # A compiling request waits like a queued one, and counts against the worker's queue limit.
        stats["waiting"] += len(self.compiles)
        return {**stats, "prefix_queries": blocks.prefix_queries, "prefix_hits": blocks.prefix_hits,
                "adds_applied": self.adds_applied, "steps": self.steps}

    def _take(self, commands: queue.SimpleQueue) -> list:
        """Every command waiting; when there is nothing to step, block until one comes (or a compile ends)."""
        batch = []
        if not self.engine.has_work():
            self.stats_log.maybe_log()  # the tail of a busy spell
            # Until a stats line is due or a compile's time limit needs checking, whichever comes first.
            waits = [s for s in (self.stats_log.seconds_until_due(), self.compiles.seconds_until_due())
                     if s is not None]
            try:
                batch.append(commands.get(timeout=min(waits, default=None)))
            except queue.Empty:
                return batch
        while True:
            try:
                batch.append(commands.get_nowait())
            except queue.Empty:
                return batch

    def _apply(self, command: dict) -> None:
        kind = command["type"]
        if kind == "add":
            request_id = command["id"]
            self.adds_applied += 1
            try:
                self._add(request_id, command["prompt"], protocol.params_from_dict(command["params"]),
                          command.get("output") or [], command.get("seed"), bool(command.get("resume")),
                          command.get("adapter") or "")
            except Exception as e:  # noqa: BLE001 - whatever a request brings fails that request alone
                self._fail(request_id, e)
            else:
                self.live.add(request_id)
        elif kind == "pool":
            request_id = command["id"]
            self.adds_applied += 1
            try:
                self.engine.add_pooling_request(request_id, command["prompt"],
                                                protocol.pooling_from_dict(command["pooling"]),
                                                command.get("adapter") or "")
            except Exception as e:  # noqa: BLE001 - whatever a request brings fails that request alone
                self._fail(request_id, e)
            else:
                self.live.add(request_id)
        elif kind in ("load_adapter", "unload_adapter"):
            self._adapter_command(command)
        elif kind == "abort":
            self.engine.abort(command["id"])
            self.compiles.discard(command["id"])
            self.live.discard(command["id"])
        else:
            raise protocol.ProtocolError(f"unknown command {kind!r}")

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, output: list[int],
             seed: int | None, resume: bool, adapter: str = "") -> None:
        if request_id in self.compiles:
            raise InvalidArgument(f"request id {request_id!r} is already in use")
        seq = self.engine.new_sequence(request_id, prompt, params, output, seed, adapter)
        seq.resumed = resume
        if params.structured_output is None:
            self.engine.admit(seq)
        else:
            self.compiles.submit(seq)  # its outputs, if any, are replayed where its grammar compiles

    def _adapter_command(self, command: dict) -> None:
        """Load or unload a LoRA adapter between steps; the reply (and the adapters now loaded) go in the next frame."""
        try:
            if command["type"] == "load_adapter":
                info = self.engine.load_adapter(command["name"], command["path"])
            else:
                self.engine.unload_adapter(command["name"])
                info = None
        except Exception as e:  # noqa: BLE001 - a bad adapter fails its command alone
            if not isinstance(e, ServiceError):
                log.exception("adapter command %s failed", command["type"])
                e = InvalidArgument(f"{command['type']} failed: {type(e).__name__}: {e}")
            self.adapter_replies.append([command["id"], protocol.error_to_list("", e)[1], str(e), None])
        else:
            self.adapter_replies.append([command["id"], "", "", info])

    def _admit_compiled(self) -> None:
        """Requests whose grammar has compiled join the batch; those whose compile failed or timed out end."""
        if not len(self.compiles):
            return
        ready, failed = self.compiles.take_settled()
        for seq in ready:
            try:
                self.engine.admit(seq)
            except Exception as e:  # noqa: BLE001 - e.g. the queue filled while it compiled
                self.live.discard(seq.request_id)
                self._fail(seq.request_id, e)
        for request_id, error in failed:
            self.live.discard(request_id)
            self._fail(request_id, error)

    def _fail(self, request_id: str, error: Exception) -> None:
        """Ends one request with an error status; anything but a ServiceError is logged as the bug it is."""
        if not isinstance(error, ServiceError):
            log.error("request %s could not be added; it fails alone and the core serves on", request_id,
                      exc_info=error)
            error = InvalidArgument(f"the request could not be added: {type(error).__name__}: {error}")
        self.errors.append(protocol.error_to_list(request_id, error))

    def _wake(self) -> None:
        """On a compile thread, as a compile ends."""
        if self._commands is not None:
            self._commands.put(_WAKE)

    def _step(self) -> None:
        self.stats_log.step_started()
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; the engine core stops, since its device may be unusable")
            error = Unavailable(f"the engine failed: {type(e).__name__}: {e}; the worker is restarting it, retry")
            self.errors.extend(protocol.error_to_list(request_id, error) for request_id in sorted(self.live))
            self.live.clear()
            # Each open request hears why before the socket closes; "dead" says the errors are the core's end,
            # which a worker that carries its streams on to the next core reads instead of them.
            self._send_update([], None, dead=f"{type(e).__name__}: {e}")
            raise EngineDeadError(f"{type(e).__name__}: {e}") from e
        seconds = time.perf_counter() - start
        self.steps += 1
        for output in outputs:
            if output.finish_reason is not None:
                self.live.discard(output.request_id)
        pooled = self.engine.take_pooled() if self.engine.pooled else ()
        for output in pooled:
            self.live.discard(output.request_id)
        self._send_update(outputs, seconds, pooled=pooled)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %d tokens in %.1f ms", self.steps, len(outputs), seconds * 1e3)
        self.stats_log.step_done(len(outputs))

    def _send_update(self, outputs: list[StepOutput], seconds: float | None, dead: str | None = None,
                     pooled: Sequence[PoolingOutput] = ()) -> None:
        stored, evicted = self.engine.block_manager.take_events()
        message = {"type": "update", "outputs": [protocol.output_to_list(o) for o in outputs], "errors": self.errors,
                   "step_seconds": seconds, "stats": self.stats(), "kv_stored": [h.hex() for h in stored],
                   "kv_evicted": [h.hex() for h in evicted]}
        if pooled:
            message["pooled"] = [protocol.pooled_to_list(o) for o in pooled]
        if self.adapter_replies:
            message["adapter_replies"], self.adapter_replies = self.adapter_replies, []
            message["adapters"] = self.engine.adapters.infos()
        if dead is not None:
            message["dead"] = dead
        self.send(message)
        self.errors = []


def read_commands(sock: socket.socket, commands: queue.SimpleQueue, loading: threading.Event) -> None:
    """The reader thread: frames into the queue, so the worker's writes never wait on a busy step."""
    try:
        with sock.makefile("rb") as stream:
            while (message := protocol.read_blocking(stream)) is not None:
                commands.put(message)
    except ConnectionError:
        pass  # the worker is gone, as at end of file
    except Exception as e:  # noqa: BLE001 - the main thread raises it, and exits
        commands.put(e)
        return
    if loading.is_set():
        log.info("the worker is gone; stopping before the model has loaded")
        os._exit(0)  # the main thread is inside the load and would finish it for nobody
    commands.put(None)


def ready_info(engine: LLMEngine) -> dict:
    """What the worker's GetInfo reports about the model, besides live stats."""
    return {"dtype": str(engine.dtype).removeprefix("torch."), "device": str(engine.device),
            "max_model_len": engine.max_model_len, "vocab_size": engine.config.vocab_size,
            "eos_token_ids": sorted(engine.eos_ids), "block_size": engine.kv_cache.block_size,
            "is_demo_checkpoint": engine.is_demo_checkpoint, "has_lm_head": engine.has_lm_head,
            "tensor_parallel_size": engine.engine_config.tensor_parallel_size,
            "speculative_method": engine.engine_config.speculative.method or "",
            "lora_enabled": engine.adapters.enabled, "adapters": engine.adapters.infos(),
            "cpus": cpu_affinity.current(), "threads": torch.get_num_threads()}


def load_engine(checkpoint: str, config_json: str) -> tuple[LLMEngine | None, str]:
    """The engine, or why it cannot be built."""
    try:
        return LLMEngine(checkpoint, EngineConfig.from_dict(json.loads(config_json))), ""
    except (ConfigError, LoadError) as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - the worker must hear why, whatever it was
        log.exception("cannot load %s", checkpoint)
        return None, f"{type(e).__name__}: {e}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.model_worker.core.engine_core",
                                     description="the model worker's engine process; the worker starts it")
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the worker's socket pair")
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory")
    parser.add_argument("--config", required=True, help="the EngineConfig as JSON")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--stats-interval", type=float, default=10.0, help="seconds between stats lines (0: none)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    # The worker owns shutdown: on SIGTERM it drains its streams first, then sends "shutdown".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The worker's step watchdog asks where a hung step is stuck before it kills this process.
    faulthandler.register(protocol.DUMP_STACKS_SIGNAL, all_threads=True)
    sock = socket.socket(fileno=args.fd)
    commands: queue.SimpleQueue = queue.SimpleQueue()
    loading = threading.Event()  # set while the model loads, when only the reader thread can notice the worker go
    loading.set()
    threading.Thread(target=read_commands, args=(sock, commands, loading), name="engine-core-reader",
                     daemon=True).start()

    def send(message: dict) -> None:
        sock.sendall(protocol.encode(message))

    engine, failure = load_engine(args.checkpoint, args.config)
    loading.clear()  # from here on the main thread answers the end of the socket itself
    try:
        if engine is None:
            send({"type": "failed", "message": failure})
            return 1
        core = EngineCore(engine, send, args.stats_interval)
        # Everything alive now lives as long as the process (mostly the imports and the model), and a step at 256
        # sequences allocates a few objects per sequence: collector.settle says why both matter.
        collector.settle()
        send({"type": "ready", "info": ready_info(engine), "stats": core.stats()})
        core.run(commands)
    except (BrokenPipeError, ConnectionResetError):
        log.info("the worker is gone; exiting")
        return 0
    except EngineDeadError:
        return protocol.EXIT_ENGINE_DEAD
    except Exception:  # noqa: BLE001 - never die silently: the worker turns this exit into UNAVAILABLE
        log.exception("the engine core failed outside a step; exiting")
        return 1
    finally:
        if engine is not None:
            engine.close()  # the other tensor-parallel ranks, if any, stop with this one
    return 0


if __name__ == "__main__":
    sys.exit(main())
