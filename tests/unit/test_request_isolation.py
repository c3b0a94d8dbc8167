"""One request never ends the engine core: a bad schema, a failing add or a slow grammar compile fails or delays
that request alone, while its neighbours in the same core step on, on a tiny random Qwen3 with the real vocabulary
(llguidance needs its tokenizer.json). Tokens are checked against transformers' greedy decoding of the same files."""
from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
from dataclasses import dataclass, field

import pytest
import torch
from tokenizers import Tokenizer

from demo.vocab import write_tokenizer_files
from rpcserver.errors import InvalidArgument
from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams, StructuredOutput
from services.model_worker.core import protocol
from services.model_worker.core.client import EngineClient
from services.model_worker.core.engine_core import EngineCore
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.executor import grammar as grammar_module
from services.model_worker.executor.grammar import MAX_NESTING_DEPTH, GrammarEngine, grammar_text, nesting_depth
from services.model_worker.server.servicer import structured_output
from tests.checkpoints import make_checkpoint
from vllm_v0.worker.v1 import worker_pb2

VOCAB = 151936
EOS = (151645, 151643)
WAIT_S = 60  # bounded waits on conditions, never a measure of speed
START_S = 120  # a core process's start: a fresh Python importing torch and loading the model
PROMPT = [9707, 11, 1879, 0, 374]
DIGITS = r"[0-9]{4}"


@pytest.fixture(scope="module")
def checkpoint_and_reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-real-vocab-isolation")
    write_tokenizer_files(path)
    model = make_checkpoint(path, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_id=EOS)
    return path, model


@pytest.fixture(scope="module")
def checkpoint(checkpoint_and_reference):
    return checkpoint_and_reference[0]


@pytest.fixture(scope="module")
def reference(checkpoint_and_reference):
    """transformers' Qwen3 on the same files, decoding greedily one token at a time."""
    model = checkpoint_and_reference[1].eval()

    def greedy_tokens(prompt: list[int], count: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(count):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt):]

    return greedy_tokens


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json"))


def greedy(max_tokens: int, constraint: StructuredOutput | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_output=constraint)


def nested_schema(levels: int) -> dict:
    """An object holding an object ... `levels` deep: the schema that ended the core."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def add(request_id: str, params: SamplingParams, prompt: list[int] = PROMPT) -> dict:
    return {"type": "add", "id": request_id, "prompt": prompt, "params": protocol.params_to_dict(params)}


def make_engine(checkpoint, **config) -> LLMEngine:
    return LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="float32", num_blocks=256, block_size=8, **config))


@dataclass
class Seen:
    """What the worker has read from the core so far, per request."""
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    errors: dict[str, tuple[str, str]] = field(default_factory=dict)


class CoreOnThread:
    """An EngineCore running its loop on a thread, as on its process's main thread: commands in, frames out."""

    def __init__(self, engine: LLMEngine):
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.frames: queue.Queue = queue.Queue()
        self.core = EngineCore(engine, self.frames.put, stats_interval_s=0)
        self.seen = Seen()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.core.run(self.commands)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.failure = e

    def send(self, *commands: dict) -> None:
        for command in commands:
            self.commands.put(command)

    def read_until(self, condition, timeout: float = WAIT_S) -> bool:
        """Reads frames until `condition(seen)` holds; False if it does not within `timeout` seconds."""
        deadline = threading.Event()
        timer = threading.Timer(timeout, deadline.set)
        timer.start()
        try:
            while not condition(self.seen):
                if deadline.is_set() or not self.thread.is_alive():
                    return condition(self.seen)
                try:
                    frame = self.frames.get(timeout=0.05)
                except queue.Empty:
                    continue
                for output in map(protocol.output_from_list, frame["outputs"]):
                    self.seen.tokens.setdefault(output.request_id, []).append(output.token_id)
                    if output.finish_reason is not None:
                        self.seen.finished.add(output.request_id)
                for request_id, kind, message in frame["errors"]:
                    self.seen.errors[request_id] = (kind, message)
            return True
        finally:
            timer.cancel()

    def stop(self) -> None:
        """Shuts the core down; it must still be running its loop, and end it without an exception."""
        assert self.thread.is_alive() and self.failure is None, self.failure
        self.send({"type": "shutdown"})
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive() and self.failure is None, self.failure


def ended(*request_ids: str):
    return lambda seen: all(r in seen.finished or r in seen.errors for r in request_ids)


# -- the engine core ----------------------------------------------------------------------------------


def test_a_deeply_nested_schema_fails_alone_and_the_core_serves_on(checkpoint, reference):
    engine = make_engine(checkpoint)
    core = CoreOnThread(engine)
    try:
        core.send(add("neighbour", greedy(24)), add("deep", greedy(8, StructuredOutput.json_schema(nested_schema(70)))))
        assert core.read_until(ended("neighbour", "deep"))
        kind, message = core.seen.errors["deep"]
        assert kind == "invalid_argument" and "nested" in message and str(MAX_NESTING_DEPTH) in message
        assert "neighbour" not in core.seen.errors
        assert core.seen.tokens["neighbour"] == reference(PROMPT, 24)
        # Still serving: a later request runs whole.
        core.send(add("after", greedy(6)))
        assert core.read_until(ended("after"))
        assert core.seen.tokens["after"] == reference(PROMPT, 6)
        core.stop()
    finally:
        engine.close()


def test_any_exception_while_a_request_is_added_fails_that_request_alone(checkpoint, reference, monkeypatch):
    engine = make_engine(checkpoint)
    real_new_sequence = engine.new_sequence

    def new_sequence(request_id, *args):
        if request_id == "boom":
            raise RuntimeError("an add that went wrong")
        return real_new_sequence(request_id, *args)

    monkeypatch.setattr(engine, "new_sequence", new_sequence)
    core = CoreOnThread(engine)
    try:
        unknown_field = add("bad params", greedy(4))
        unknown_field["params"]["no_such_field"] = 1  # params_from_dict raises TypeError
        core.send(add("a", greedy(20)), add("boom", greedy(4)), unknown_field, add("b", greedy(12), [7, 8, 9]))
        assert core.read_until(ended("a", "b", "boom", "bad params"))
        assert core.seen.errors["boom"] == ("invalid_argument",
                                            "the request could not be added: RuntimeError: an add that went wrong")
        kind, message = core.seen.errors["bad params"]
        assert kind == "invalid_argument" and "TypeError" in message and "no_such_field" in message
        assert core.seen.tokens["a"] == reference(PROMPT, 20)
        assert core.seen.tokens["b"] == reference([7, 8, 9], 12)
        assert set(core.seen.errors) == {"boom", "bad params"}
        core.stop()
    finally:
        engine.close()


def hold_compiles(engine) -> tuple[threading.Event, threading.Event]:
    """Make the engine's grammar compiles wait: (set when one starts, set to let it finish)."""
    real_matcher = engine.grammar.matcher
    compiling, release = threading.Event(), threading.Event()

    def slow_matcher(constraint, *replay):
        compiling.set()
        release.wait(WAIT_S)
        return real_matcher(constraint, *replay)

    engine.grammar.matcher = slow_matcher
    return compiling, release


def test_a_slow_compile_does_not_hold_back_the_other_requests_steps(checkpoint, reference, tokenizer):
    """The compile is held until the neighbour has stepped on: were it on the step's path, nothing would step."""
    engine = make_engine(checkpoint)
    compiling, release = hold_compiles(engine)
    core = CoreOnThread(engine)
    try:
        core.send(add("slow", SamplingParams(temperature=1.0, seed=1, max_tokens=8,
                                             structured_output=StructuredOutput("regex", DIGITS))),
                  add("neighbour", greedy(30)))
        assert compiling.wait(WAIT_S)
        stepped = core.read_until(lambda seen: len(seen.tokens.get("neighbour", [])) >= 10)
        still_compiling = not release.is_set() and "slow" not in core.seen.tokens
        release.set()
        assert stepped and still_compiling
        assert core.read_until(ended("slow", "neighbour"))
        assert core.seen.tokens["neighbour"] == reference(PROMPT, 30)
        assert re.fullmatch(DIGITS, tokenizer.decode(core.seen.tokens["slow"])) and not core.seen.errors
        core.stop()
    finally:
        release.set()
        engine.close()


def test_a_compile_past_its_time_limit_fails_its_request_alone(checkpoint, reference):
    engine = make_engine(checkpoint, grammar_compile_timeout_s=0.5)
    release = threading.Event()

    def stuck_matcher(constraint, *replay):
        engine.grammar.tokenizer  # noqa: B018 - loaded first, as the real compile does: the limit runs from here
        release.wait(WAIT_S)
        raise AssertionError("a compile past its time limit must not be waited for")

    engine.grammar.matcher = stuck_matcher
    core = CoreOnThread(engine)
    try:
        core.send(add("stuck", greedy(4, StructuredOutput("regex", DIGITS))))
        # Nothing else to step: the idle core must still notice the limit pass.
        assert core.read_until(ended("stuck"))
        assert core.seen.errors["stuck"] == ("resource_exhausted",
                                             "structured_output regex did not compile within 0.5 s; simplify it")
        core.send(add("after", greedy(10)))
        assert core.read_until(ended("after"))
        assert core.seen.tokens["after"] == reference(PROMPT, 10)
        core.stop()
    finally:
        release.set()
        engine.close()


def test_an_aborted_request_leaves_its_compile_behind(checkpoint, reference):
    engine = make_engine(checkpoint)
    compiling, release = hold_compiles(engine)
    core = CoreOnThread(engine)
    try:
        core.send(add("gone", greedy(4, StructuredOutput("regex", DIGITS))))
        assert compiling.wait(WAIT_S)
        core.send({"type": "abort", "id": "gone"})
        release.set()
        core.send(add("after", greedy(8)))
        assert core.read_until(ended("after"))
        assert core.seen.tokens["after"] == reference(PROMPT, 8)
        assert "gone" not in core.seen.tokens and "gone" not in core.seen.errors
        assert core.core.stats()["waiting"] == 0
        core.stop()
    finally:
        release.set()
        engine.close()


def test_a_deep_schema_in_the_core_process_fails_alone_and_the_process_lives(checkpoint, reference):
    """The real process, through the worker's client: the request gets INVALID_ARGUMENT, the stream beside it
    finishes whole, and the core is the same process, never restarted."""
    async def main():
        client = EngineClient(checkpoint, EngineConfig(device="cpu", dtype="float32", num_blocks=256, block_size=8))
        await asyncio.wait_for(client.start(), START_S)
        try:
            core = client.process
            stream = client.generate("neighbour", PROMPT, greedy(40))
            first = await stream.__anext__()
            with pytest.raises(InvalidArgument, match="nested"):
                async for _ in client.generate("deep", PROMPT, greedy(8, StructuredOutput.json_schema(
                        nested_schema(70)))):
                    pass
            tokens = [first.token_id] + [out.token_id async for out in stream]
            return tokens, client.process is core and core.popen.poll() is None, client.restarts, client.serving
        finally:
            await client.close()

    tokens, same_process_alive, restarts, serving = asyncio.run(main())
    assert tokens == reference(PROMPT, 40)
    assert same_process_alive and restarts == 0 and serving


# -- the grammar's bounds -----------------------------------------------------------------------------


def json_depth(value) -> int:
    """The reference: containers nested in a parsed JSON value, counted recursively."""
    if isinstance(value, dict):
        return 1 + max((json_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((json_depth(v) for v in value), default=0)
    return 0


@pytest.mark.parametrize("value", [
    nested_schema(3), nested_schema(40), [[[], [[]]], {"a": [{}]}],
    {"pattern": "^[{(]+\\\"[})]$", "enum": ["{[(", ")]}", "\\\\{"]},  # brackets inside strings do not count
    {"k{": {"[": [1, {"}": "]"}]}},
])
def test_nesting_depth_of_json_matches_the_parsed_depth(value):
    assert nesting_depth(json.dumps(value), quotes='"', classes=False) == json_depth(value)


def test_a_schema_past_the_depth_bound_is_refused_before_any_parser_reads_it(checkpoint):
    grammar = GrammarEngine(checkpoint, VOCAB, frozenset(EOS))
    try:
        deepest_allowed = (MAX_NESTING_DEPTH - 1) // 2  # each level is a schema object and its "properties"
        grammar.matcher(StructuredOutput.json_schema(nested_schema(min(deepest_allowed, 60))))
        for constraint in (StructuredOutput.json_schema(nested_schema(70)),
                           StructuredOutput("json_schema", "[" * 50_000 + "]" * 50_000),  # json.loads would recurse
                           StructuredOutput("regex", "(" * 200 + "a" + ")" * 200),
                           StructuredOutput("grammar", 'root ::= ' + "(" * 1000 + '"a"' + ")" * 1000)):
            with pytest.raises(InvalidArgument, match=f"structured_output {constraint.kind} is nested"):
                grammar.matcher(constraint)
        # Escaped and class brackets are text, not nesting.
        grammar.matcher(StructuredOutput("regex", r"\(" * 300 + "[(]" * 300))
    finally:
        grammar.close()


def test_llguidance_refusals_of_a_schema_are_invalid_argument_past_the_bounds_check():
    """Whatever the JSON compiler raises (a plain ValueError past its own depth) names the constraint."""
    with pytest.raises(InvalidArgument, match="structured_output json_schema is invalid: recursion limit"):
        grammar_text(StructuredOutput.json_schema(nested_schema(70)))


def test_the_bound_on_size_holds_in_the_core_too(checkpoint, monkeypatch):
    """The front checks the length; the core checks again, since a command may come from anywhere."""
    monkeypatch.setattr(grammar_module, "MAX_STRUCTURED_CHARS", 10)
    grammar = GrammarEngine(checkpoint, VOCAB, frozenset(EOS))
    try:
        with pytest.raises(InvalidArgument, match="is 11 characters; at most 10"):
            grammar.matcher(StructuredOutput("regex", "a" * 11))
    finally:
        grammar.close()


# -- the worker's request conversion ------------------------------------------------------------------


def test_a_constraint_that_starts_after_a_token_converts_from_the_proto():
    """The gateway sets start_after_token_id when the model thinks first (thinking on, the chat default)."""
    message = worker_pb2.StructuredOutput(json_schema='{"type": "object"}', start_after_token_id=151668)
    constraint = structured_output(message)
    assert (constraint.kind, constraint.value, constraint.start_after) == ("json_schema", '{"type": "object"}',
                                                                           151668)
    choice = worker_pb2.StructuredOutput(choice=worker_pb2.StructuredOutput.Choices(choices=["a", "b"]),
                                         start_after_token_id=7)
    assert structured_output(choice) == StructuredOutput("choice", json.dumps(["a", "b"]), start_after=7)
    assert structured_output(worker_pb2.StructuredOutput(regex="x")).start_after is None


def test_the_compile_time_limit_comes_from_its_flag(capsys):
    from services.model_worker.main import engine_config, parse_args

    assert engine_config(parse_args(["--grammar-compile-timeout", "2.5"])).grammar_compile_timeout_s == 2.5
    with pytest.raises(SystemExit):
        parse_args(["--grammar-compile-timeout", "0"])
    assert "--grammar-compile-timeout must be > 0, got 0.0" in capsys.readouterr().err
