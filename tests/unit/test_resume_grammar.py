"""A structured-output request resumed after output ids: its grammar replays them before its next mask, on the
engine's own path and on the engine core's compile thread alike, and refuses ids that would have ended the request
(tiny random Qwen3 with the real vocabulary, which llguidance needs)."""
from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from demo.vocab import write_tokenizer_files
from rpcserver.errors import InvalidArgument
from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams, StructuredOutput
from services.model_worker.core import protocol
from services.model_worker.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint
from tests.unit.test_request_isolation import CoreOnThread, ended

VOCAB = 151936
EOS = (151645, 151643)
PROMPT = [9707, 11, 1879, 0, 374]
SCHEMA = StructuredOutput.json_schema({
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                     "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                              "maxItems": 3}},
    "required": ["name", "tags"], "additionalProperties": False})
DIGITS = StructuredOutput("regex", r"[0-9]{6}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-real-vocab-resume")
    write_tokenizer_files(path)
    make_checkpoint(path, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_id=EOS)
    return path


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json"))


@pytest.fixture()
def engine(checkpoint):
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="float32", num_blocks=256, block_size=8,
                                                enable_prefix_caching=False))
    yield engine
    engine.close()


def params(constraint: StructuredOutput, max_tokens: int = 80, **extra) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **extra}, max_tokens=max_tokens, structured_output=constraint)


def run(engine: LLMEngine, request_id: str, sampling: SamplingParams, output_ids=()) -> tuple[list[int], str]:
    engine.add_request(request_id, PROMPT, sampling, list(output_ids))
    tokens, reason = [], None
    while reason is None:
        for out in engine.step():
            if out.request_id == request_id:
                tokens.append(out.token_id)
                reason = out.finish_reason
    return tokens, reason.value


@pytest.mark.parametrize("sampled", [False, True])
def test_a_grammar_replays_the_given_ids_then_goes_on_exactly(engine, tokenizer, sampled):
    extra = dict(temperature=0.8, seed=5) if sampled else {}
    whole, reason = run(engine, "whole", params(SCHEMA, **extra))
    assert reason == "eos" and json.loads(tokenizer.decode(whole))  # the grammar completed: a whole object
    for k in (1, len(whole) // 2, len(whole) - 1):
        head, _ = run(engine, f"head{k}", params(SCHEMA, max_tokens=k, **extra))
        assert head == whole[:k]
        rest, reason = run(engine, f"rest{k}", params(SCHEMA, **extra), head)
        assert (rest, reason) == (whole[k:], "eos"), k


def test_the_engine_core_replays_on_its_compile_thread(engine):
    whole, _ = run(engine, "whole", params(SCHEMA))
    core = CoreOnThread(engine)
    k = len(whole) // 2
    core.send({"type": "add", "id": "resumed", "prompt": PROMPT, "params": protocol.params_to_dict(params(SCHEMA)),
               "output": whole[:k]})
    assert core.read_until(ended("resumed"))
    assert core.seen.tokens["resumed"] == whole[k:] and "resumed" in core.seen.finished
    core.stop()


def test_the_replay_crosses_the_token_the_constraint_starts_after(engine, tokenizer):
    """Before that token nothing is matched; after it, the ids are, and the mask is the one a live run has."""
    think_end = tokenizer.token_to_id("</think>")
    free = tokenizer.encode("hmm, ok").ids
    digits = tokenizer.encode("12").ids
    constraint = StructuredOutput(DIGITS.kind, DIGITS.value, start_after=think_end)
    live = engine.grammar.matcher(constraint)
    for token in free + [think_end] + digits:
        assert live.accept(token)
    replayed = engine.grammar.matcher(constraint, free + [think_end] + digits)
    assert replayed.active and torch.equal(replayed.mask(), live.mask())
    waiting = engine.grammar.matcher(constraint, free)
    assert not waiting.active  # still inside the reasoning
    # Before the start token a digit-refusing id is fine; after it, it is not.
    letters = tokenizer.encode("abc").ids
    engine.grammar.matcher(constraint, letters)
    with pytest.raises(InvalidArgument, match=r"output_token_ids\[1\] = \d+ is refused"):
        engine.grammar.matcher(constraint, [think_end] + letters)


def test_ids_the_grammar_refuses_or_completes_on_are_refused_on_both_paths(engine, tokenizer):
    letter = tokenizer.encode("x").ids
    digits = tokenizer.encode("123456").ids
    assert len(digits) == 6  # Qwen splits numbers into single digits
    with pytest.raises(InvalidArgument, match=r"output_token_ids\[1\] = \d+ is refused by the structured_output"):
        engine.add_request("refused", PROMPT, params(DIGITS), digits[:1] + letter)
    with pytest.raises(InvalidArgument, match=r"grammar is complete at output_token_ids\[5\]"):
        engine.add_request("complete", PROMPT, params(DIGITS), digits)
    assert not engine.has_work()
    core = CoreOnThread(engine)
    for request_id, output in (("refused", digits[:2] + letter), ("complete", digits), ("fine", digits[:3])):
        core.send({"type": "add", "id": request_id, "prompt": PROMPT, "params": protocol.params_to_dict(params(DIGITS)),
                   "output": output})
    assert core.read_until(ended("refused", "complete", "fine"))
    kind, message = core.seen.errors["refused"]
    assert kind == "invalid_argument" and "output_token_ids[2]" in message and "refused" in message
    kind, message = core.seen.errors["complete"]
    assert kind == "invalid_argument" and "complete at output_token_ids[5]" in message
    assert len(core.seen.tokens["fine"]) == 3 and "fine" in core.seen.finished
    core.stop()
