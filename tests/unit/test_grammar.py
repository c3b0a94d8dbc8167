"""Structured output in the worker: the bitmask at the logits, the matcher's advance, and the engine's step,
on a tiny random Qwen3 with the real Qwen3 vocabulary (decoded independently by `tokenizers`)."""
import json
import re
import threading
import time

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from demo.vocab import write_tokenizer_files
from rpcserver.errors import InvalidArgument
from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams, StructuredOutput
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.executor.grammar import GrammarEngine, apply_token_bitmask
from tests.checkpoints import make_checkpoint

VOCAB = 151936
EOS = (151645, 151643)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "alive": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "home": {"type": "object", "properties": {"floor": {"type": "integer", "minimum": 0, "maximum": 99}},
                 "required": ["floor"], "additionalProperties": False},
    },
    "required": ["name", "kind", "alive", "tags", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-real-vocab-grammar")
    write_tokenizer_files(path)
    make_checkpoint(path, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_id=EOS)
    return path


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json"))


@pytest.fixture(scope="module")
def grammar(checkpoint):
    engine = GrammarEngine(checkpoint, VOCAB, frozenset(EOS))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="float32", num_blocks=256, block_size=8))
    yield engine
    engine.close()


def allowed_ids(mask: torch.Tensor) -> set[int]:
    """The set bits, read one by one in plain Python: the reference for the vectorised unpacking."""
    words = mask.flatten().tolist()
    return {w * 32 + b for w, word in enumerate(words) for b in range(32) if (word >> b) & 1}


# float64 takes the torch path a GPU's logits take; the others numpy's bit-pattern copy.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_apply_token_bitmask_against_bit_by_bit_reference(dtype):
    vocab = 70  # not a multiple of 32: the last word's spare bits are ignored
    with torch.inference_mode():  # as the runner's logits are
        logits = torch.randn(3, vocab).to(dtype)
    before = logits.clone()
    mask = torch.randint(-2**31, 2**31 - 1, (1, 3), dtype=torch.int32)
    logits = apply_token_bitmask(logits, [1], [mask])
    keep = allowed_ids(mask)
    for t in range(vocab):
        assert logits[1, t].item() == (before[1, t].item() if t in keep else float("-inf"))
    assert torch.equal(logits[[0, 2]], before[[0, 2]])  # other rows untouched


def test_regex_mask_allows_exactly_digit_tokens(grammar, tokenizer):
    state = grammar.matcher(StructuredOutput("regex", "[0-9]{2,3}"))
    allowed = allowed_ids(state.mask())
    digits = {i for i in range(tokenizer.get_vocab_size()) if re.fullmatch(r"[0-9]{1,3}", tokenizer.decode([i]))}
    assert digits and allowed == digits  # Qwen splits numbers into single digits
    assert all(t < VOCAB for t in allowed)


def test_matcher_advances_and_completes(grammar, tokenizer):
    state = grammar.matcher(StructuredOutput.json_schema(json.dumps({"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False})))
    ids = tokenizer.encode('{"ok":true}').ids
    for t in ids[:-1]:
        assert t in allowed_ids(state.mask())
        assert state.accept(t) and not state.is_complete
    assert state.accept(ids[-1]) and state.is_complete
    # A token the grammar cannot take is refused.
    fresh = grammar.matcher(StructuredOutput("choice", json.dumps(["yes", "no"])))
    assert not fresh.accept(tokenizer.encode("maybe").ids[0])


class _SlowFills:
    """The real matcher and pool, with fills that take their time and a record of any matcher call made between a
    fill's submission and its end (llguidance refuses those with "Already mutably borrowed")."""

    def __init__(self, state):
        self._matcher, self._pool, self._filling, self.overlaps = state.matcher, state._pool, threading.Event(), []
        state.matcher, state._pool = self, self

    def submit(self, fn):
        self._filling.set()
        return self._pool.submit(fn)

    def unsafe_compute_mask_ptr(self, *args):
        try:
            time.sleep(0.05)
            return self._matcher.unsafe_compute_mask_ptr(*args)
        finally:
            self._filling.clear()

    def __getattr__(self, name):
        if self._filling.is_set():
            self.overlaps.append(name)
        return getattr(self._matcher, name)


def test_the_matcher_is_never_touched_while_the_next_mask_fills(grammar, tokenizer):
    state = grammar.matcher(StructuredOutput("json_object"))
    state.mask()
    slow = _SlowFills(state)
    for t in tokenizer.encode('{"a":1}').ids:
        assert state.accept(t)
        state.is_complete  # the sequence asks right after each token, while the next fill runs
        state.mask()
    assert state.is_complete and slow.overlaps == []


def test_whitespace_is_not_allowed_between_json_tokens(grammar, tokenizer):
    state = grammar.matcher(StructuredOutput("json_object"))
    first = allowed_ids(state.mask())
    assert tokenizer.encode("{").ids[0] in first
    assert not any(tokenizer.decode([t]).strip() == "" and tokenizer.decode([t]) for t in first)


@pytest.mark.parametrize("constraint, needle", [
    (StructuredOutput("json_schema", '{"type": "object"'), "not JSON"),
    (StructuredOutput("json_schema", '{"type": "strng"}'), "strng"),
    (StructuredOutput("regex", "[a-z"), "regex"),
    (StructuredOutput("grammar", "root ::= ("), "grammar"),
])
def test_invalid_constraints_name_the_problem(grammar, constraint, needle):
    with pytest.raises(InvalidArgument, match=f"structured_output {constraint.kind}") as e:
        grammar.matcher(constraint)
    assert needle in str(e.value)


def test_engine_outputs_validate_and_leave_unconstrained_rows_unchanged(engine, tokenizer):
    prompt = tokenizer.encode("Describe a pet as JSON:").ids
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    (alone,) = engine.generate([prompt], plain)
    for seed in range(4):
        constrained = SamplingParams(temperature=1.0, seed=seed, max_tokens=100,
                                     structured_output=StructuredOutput.json_schema(SCHEMA))
        regex = SamplingParams(temperature=1.0, seed=seed, max_tokens=30,
                               structured_output=StructuredOutput("regex", r"[A-Z][a-z]{1,5} [0-9]{2}"))
        together, out, matched = engine.generate([prompt, prompt, prompt], [plain, constrained, regex])
        assert together == alone
        assert out[-1] not in EOS  # the grammar's completion ended it, before any eos
        jsonschema.validate(json.loads(tokenizer.decode(out)), SCHEMA)
        assert re.fullmatch(r"[A-Z][a-z]{1,5} [0-9]{2}", tokenizer.decode(matched))


def test_engine_refuses_an_invalid_schema(engine, tokenizer):
    bad = SamplingParams(structured_output=StructuredOutput("json_schema", '{"type": 7}'))
    with pytest.raises(InvalidArgument, match="json_schema"):
        engine.add_request("bad", tokenizer.encode("hi").ids, bad)


def test_params_cross_the_core_socket_as_json():
    from services.model_worker.core import protocol

    params = SamplingParams(structured_output=StructuredOutput.choice(["a", "b"]))
    raw = json.loads(json.dumps(protocol.params_to_dict(params)))
    assert protocol.params_from_dict(raw) == params


def test_a_checkpoint_without_tokenizer_json_refuses_the_request_not_the_engine(tmp_path):
    grammar = GrammarEngine(tmp_path, VOCAB, frozenset(EOS))
    with pytest.raises(InvalidArgument, match="tokenizer.json"):
        grammar.matcher(StructuredOutput("regex", "a"))


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutput("xml", "x"), "kind must be one of"),
    (StructuredOutput("choice", "[]"), "at least one"),
    (StructuredOutput("choice", '["a", 3]'), "list of strings"),
    (StructuredOutput("regex", ""), "regex is empty"),
])
def test_the_front_checks_the_shape_before_the_core(constraint, message):
    with pytest.raises(InvalidArgument, match=message):
        SamplingParams(structured_output=constraint).validate(VOCAB)


def test_a_constraint_that_starts_after_the_reasoning_leaves_the_think_block_free(engine, tokenizer):
    """start_after (Qwen3's </think>): before it nothing is masked; from the token after it, the grammar holds."""
    think_end = tokenizer.token_to_id("</think>")
    letter = tokenizer.encode("x").ids[0]
    prompt = tokenizer.encode("Count:").ids
    digits = StructuredOutput("regex", r"[0-9]{3}", start_after=think_end)
    # +100 on a letter: while the constraint waits, the letter (no digit) is what comes out.
    (free,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, logit_bias={letter: 100.0},
                                                       structured_output=digits))
    assert free == [letter] * 6
    # +100 on </think>: the reasoning ends at once, and the digits follow, then the grammar ends the sequence.
    (out,) = engine.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                                                      logit_bias={think_end: 100.0}, structured_output=digits))
    assert out[0] == think_end and re.fullmatch(r"[0-9]{3}", tokenizer.decode(out[1:]))
