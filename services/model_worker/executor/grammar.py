"""Structured output at the logits: llguidance grammars, one matcher per sequence, and the token bitmask.

Why llguidance rather than xgrammar (measured in docs/http-api.md): `import xgrammar` imports
transformers, which the worker never loads; llguidance builds its tokenizer straight from the
checkpoint's tokenizer.json, compiles a schema in ~1.5 ms (xgrammar: ~43 ms) and fills a mask for
Qwen's 151,936 tokens in ~0.05 ms a step.

JSON is generated compact (no whitespace between tokens of the JSON syntax), so even a model with
random weights cannot stall an object with spaces: only strings and numbers can run long.

Everything here is fed text a client wrote. Its size and nesting depth are checked before any parser
sees it (Python's json and llguidance's GBNF converter recurse, and llguidance's JSON compiler refuses
past a depth of its own with a plain ValueError); llguidance's fuel limits bound the work of a compile
and of each mask; and the engine core compiles on compile_pool's threads, under a time limit
(core/grammar_compiles.py), so no grammar holds back another request's step.
"""
from __future__ import annotations

import json
import pathlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy
import torch

from rpcserver.errors import InvalidArgument, ServiceError
from services.model_worker.config.sampling import MAX_STRUCTURED_CHARS, StructuredOutput

# Compact JSON: "," and ":" with no whitespace around them (OpenAI's and vLLM's outputs may hold
# spaces; a parser cannot tell the difference).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

# Brackets open at once in a constraint's text. llguidance's JSON compiler refuses a schema of about 64
# nested objects (128 brackets: each level is a schema object and its "properties"), and the GBNF
# converter and Python's json recurse once a level, so deeper text is refused before either reads it.
# Real schemas stay far below: OpenAI allows 10 levels of nested objects.
MAX_NESTING_DEPTH = 128
# Threads compiling grammars: more than one, so a slow compile does not queue every other behind it.
COMPILE_THREADS = 2


def parser_limits():
    """llguidance's bounds on the work of a compile and of each mask fill, pinned here (at the values
    llguidance 1.9.1 ships by default) so that an upgrade cannot loosen them unseen: initial_lexer_fuel bounds the
    lexer's construction (~20 ms), step_lexer_fuel and step_max_items each mask (~14 ms and ~2.5 ms),
    max_grammar_size the compiled grammar, max_items_in_row a rule's alternatives."""
    import llguidance

    return llguidance.LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                     step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000)


def nesting_depth(text: str, quotes: str, classes: bool) -> int:
    """The most brackets ((, [ and {) open at once, in one linear pass: none inside quoted strings, after a
    backslash, or (classes: a regex or grammar) inside a [...] character class."""
    depth = deepest = 0
    quote, in_class, escaped = None, False, False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif quote is not None:
            quote = None if ch == quote else quote
        elif in_class:
            in_class = ch != "]"
        elif ch in quotes:
            quote = ch
        elif classes and ch == "[":
            in_class = True
        elif ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(depth - 1, 0)
    return deepest


def check_bounds(constraint: StructuredOutput) -> None:
    """InvalidArgument when a constraint's text is longer or nested deeper than any parser here is asked to take."""
    kind, value = constraint.kind, constraint.value
    if len(value) > MAX_STRUCTURED_CHARS:
        raise InvalidArgument(f"structured_output {kind} is {len(value)} characters; "
                              f"at most {MAX_STRUCTURED_CHARS} are allowed")
    if kind in ("json_schema", "choice"):
        depth = nesting_depth(value, quotes='"', classes=False)
    elif kind == "regex":
        depth = nesting_depth(value, quotes="", classes=True)
    elif kind == "grammar":
        depth = nesting_depth(value, quotes='"', classes=True)
    else:
        depth = 0
    if depth > MAX_NESTING_DEPTH:
        raise InvalidArgument(f"structured_output {kind} is nested {depth} levels deep; at most "
                              f"{MAX_NESTING_DEPTH} are allowed (flatten it, or move shared parts to $defs)")


def grammar_text(constraint: StructuredOutput) -> str:
    """The llguidance grammar for a constraint; InvalidArgument when its text is not even well formed."""
    import llguidance

    kind, value = constraint.kind, constraint.value
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise InvalidArgument(f"structured_output json_schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument("structured_output json_schema must be a JSON object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
        except ValueError as e:  # e.g. "recursion limit exceeded" past its own nesting depth
            raise InvalidArgument(f"structured_output json_schema is invalid: {_first_line(str(e))}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        # Each string is matched literally: a Lark string literal is a JSON string.
        choices = json.loads(value)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", value)  # GBNF, EBNF or Lark
        except (ValueError, RecursionError) as e:
            raise InvalidArgument(f"structured_output grammar is invalid: {_first_line(str(e))}") from None
    raise InvalidArgument(f"unknown structured_output kind {kind!r}")


class GrammarEngine:
    """The checkpoint's tokenizer as llguidance needs it (loaded on the first constrained request, ~1.5 s,
    so a worker that never sees one pays nothing), and the thread that fills masks ahead of a step."""

    def __init__(self, checkpoint_dir: pathlib.Path, vocab_size: int, eos_ids: frozenset[int]):
        self.checkpoint_dir = checkpoint_dir
        # The model's vocabulary (151,936 for Qwen3) exceeds the tokenizer's (151,669): ids past the
        # tokenizer's are never allowed.
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._compile_pool: ThreadPoolExecutor | None = None
        # When the tokenizer finished loading (time.monotonic()); None before. A compile's time limit runs
        # from here at the earliest, so the first constrained request is not failed for the load.
        self.tokenizer_loaded_at: float | None = None

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                path = self.checkpoint_dir / "tokenizer.json"
                try:
                    self._tokenizer = llguidance.LLTokenizer(path.read_text(), n_vocab=self.vocab_size,
                                                             eos_token=self.eos_ids or None)
                except (OSError, ValueError, RuntimeError) as e:
                    # A request error, not a dead engine: free text still works on this checkpoint.
                    raise InvalidArgument(f"structured_output needs the checkpoint's tokenizer.json, which this "
                                          f"worker cannot read: {type(e).__name__}: {e}") from None
                self.tokenizer_loaded_at = time.monotonic()
            return self._tokenizer

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        return self._pool

    @property
    def compile_pool(self) -> ThreadPoolExecutor:
        """Where the engine core compiles (apart from the mask thread, which a step waits on)."""
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="grammar-compile")
        return self._compile_pool

    def matcher(self, constraint: StructuredOutput, replay: list[int] = ()) -> GrammarState:
        """A matcher at the grammar's start, or past `replay` (the outputs of a resumed request), its next mask
        filled on this thread; InvalidArgument naming what is wrong with the constraint, whatever the parsers
        raised, or the replayed id that would have ended the request."""
        import llguidance

        check_bounds(constraint)
        tokenizer = self.tokenizer
        limits = parser_limits()
        try:
            grammar = grammar_text(constraint)
            error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
            if error and not error.startswith("WARNING"):
                raise InvalidArgument(f"structured_output {constraint.kind} is invalid: {_first_line(error)}")
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        except ServiceError:
            raise
        except (ValueError, RuntimeError, RecursionError) as e:  # the compiler's own refusals, whatever their spelling
            raise InvalidArgument(f"structured_output {constraint.kind} is invalid: {_first_line(str(e))}") from None
        if matcher.is_error():
            raise InvalidArgument(f"structured_output {constraint.kind} is invalid: "
                                  f"{_first_line(matcher.get_error())}")
        return GrammarState(matcher, self.vocab_size, self.pool, constraint.start_after, replay)

    def close(self) -> None:
        if self._compile_pool is not None:
            # A compile past its time limit may still run; closing does not wait for it.
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class GrammarState:
    """One sequence's matcher and its next mask, filled on the grammar thread after each accepted token
    (llguidance releases the GIL), so it is ready by the time the next step's logits are."""

    def __init__(self, matcher, vocab_size: int, pool: ThreadPoolExecutor, start_after: int | None = None,
                 replay: list[int] = ()):
        self.matcher = matcher
        self.bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        self._pool = pool
        self._pending: Future | None = None
        # Read once after each token: the matcher may not be touched while a fill runs on the pool.
        self._stopped = False
        # Until this token is generated (the end of the reasoning) nothing is masked or matched.
        self.waiting_for = start_after
        if replay:
            self._replay(replay)
        if self.active:
            # The first mask is filled here, on the constructing thread (the engine core's compile thread), not
            # on the mask thread every step waits on: a new grammar's first fill, like its compile, delays no step.
            self._fill()
            self._pending = Future()
            self._pending.set_result(None)

    def _replay(self, token_ids: list[int]) -> None:
        """Advances past tokens generated before (a resumed request), as accept() would have one by one;
        InvalidArgument at one the grammar refuses or after which it is complete: the request would have ended."""
        start = 0
        if not self.active:
            if self.waiting_for not in token_ids:
                return
            start = token_ids.index(self.waiting_for) + 1
            self.waiting_for = None
        for i in range(start, len(token_ids)):
            if not self.matcher.consume_token(token_ids[i]):
                raise InvalidArgument(f"output_token_ids[{i}] = {token_ids[i]} is refused by the structured_output "
                                      "grammar: no stream of this request could have generated it")
            if self.matcher.is_stopped():
                raise InvalidArgument(f"the structured_output grammar is complete at output_token_ids[{i}]: the "
                                      "request would have ended there")

    @property
    def active(self) -> bool:
        """Whether the constraint applies to the next token (False while the reasoning runs)."""
        return self.waiting_for is None

    def prepare(self) -> None:
        """Starts filling the mask for the matcher's current state."""
        self._pending = self._pool.submit(self._fill)

    def _fill(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)

    def mask(self) -> torch.Tensor:
        """(1, ceil(V / 32)) int32, bit t of word t // 32 set where token t is allowed."""
        if self._pending is None:
            self.prepare()
        self._pending.result()
        self._pending = None
        return self.bitmask

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token and starts the next mask; False when the grammar refused it."""
        if not self.active:
            if token_id == self.waiting_for:
                self.waiting_for = None
                self.prepare()
            return True
        if self._pending is not None:
            self._pending.result()  # never change the matcher under a fill
            self._pending = None
        ok = self.matcher.consume_token(token_id)
        self._stopped = self.matcher.is_stopped()
        if ok and not self._stopped:
            self.prepare()
        return ok

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of a proposal the grammar would accept, in order (the state is unchanged)."""
        if not self.active or not token_ids:
            return 0
        self._settle()
        return self.matcher.validate_tokens(token_ids)

    def masks_along(self, token_ids: list[int]) -> list[torch.Tensor]:
        """The masks at the current state and after each of token_ids in turn: one per verification row of a
        proposal. Past a token the grammar refuses, the rows repeat the last mask: that token is masked out
        of its own row, so it is rejected there and the rows after it are never used. The matcher is rolled
        back afterwards."""
        self._settle()
        masks = [self.mask().clone()]  # the shared buffer is refilled once the next token is accepted
        # Validated first: consuming a refused token would leave the matcher in its error state.
        valid = self.matcher.validate_tokens(token_ids) if token_ids else 0
        for token in token_ids[:valid]:
            if not self.matcher.consume_token(token):
                raise ValueError(f"the grammar refused token {token} it had validated")
            mask = torch.zeros_like(self.bitmask)
            self.matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            masks.append(mask)
        masks += [masks[-1]] * (len(token_ids) - valid)
        self.matcher.rollback(valid)
        return masks

    def _settle(self) -> None:
        """Waits for a mask being filled, so the matcher can be read and moved."""
        if self._pending is not None:
            self._pending.result()

    @property
    def is_complete(self) -> bool:
        """The grammar can take no more tokens (an EOS aside): the sequence ends here."""
        return self.active and self._stopped


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> torch.Tensor:
    """Sets the disallowed tokens of `rows` to -inf, in place, and returns the logits.

    logits: (B, V), contiguous; masks: (1, W) int32 each, bit t of word t // 32 set where token t is
    allowed (little-endian words, so the bytes' bits in order are the token ids in order).
    On a CPU, torch's masked_fill_ over a 151,936-wide bf16 row took ~7 ms on this project's machine
    and the bit unpacking in torch ops ~100 ms with its threads contended; numpy's unpackbits and a
    masked copy of the -inf bit pattern take ~1 ms, single-threaded.
    """
    vocab = logits.shape[1]
    words = torch.cat(masks).numpy()  # (R, W)
    disallowed = numpy.unpackbits(words.view(numpy.uint8), axis=1, bitorder="little")[:, :vocab] == 0  # (R, V)
    with torch.inference_mode():  # the runner's logits are inference tensors
        if logits.device.type == "cpu" and logits.dtype in _INT_VIEWS:
            int_dtype, np_dtype = _INT_VIEWS[logits.dtype]
            neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype).view(int_dtype).item()
            as_ints = logits.view(int_dtype).numpy()
            for j, r in enumerate(rows):
                numpy.copyto(as_ints[r], np_dtype(neg_inf), where=disallowed[j])
        else:
            fill = torch.from_numpy(disallowed).to(logits.device, non_blocking=True)
            index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
            logits[index] = logits[index].masked_fill(fill, float("-inf"))
    return logits


# A float dtype's same-width integer dtype, for writing -inf's bit pattern with numpy (which has no bf16).
_INT_VIEWS = {
    torch.float32: (torch.int32, numpy.int32),
    torch.bfloat16: (torch.int16, numpy.int16),
    torch.float16: (torch.int16, numpy.int16),
}


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "rejected by the grammar compiler"
