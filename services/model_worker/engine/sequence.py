"""A request's sequence: its tokens, sampling parameters, cache blocks and progress."""
from __future__ import annotations

import enum
import itertools
import logging

import torch

from services.model_worker.config.sampling import SamplingParams
from services.model_worker.executor.random_draws import fresh_seed

log = logging.getLogger(__name__)
_arrival = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    EOS = "eos"          # an eos id, a stop token id, or the structured output's grammar completed
    LENGTH = "length"    # max_tokens or the context limit
    ABORTED = "aborted"  # cancelled by the caller


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 eos_ids: frozenset[int], output_ids: list[int] = (), seed: int | None = None):
        """output_ids: tokens it generated before (a resumed request), computed with the prompt as one prefill;
        seed: its draws' seed when params has none (the worker's choice, so its own resumes draw the same)."""
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = list(output_ids)
        # Prompt then output, kept as one list: the runner and block manager slice it every step.
        self.token_ids: list[int] = self.prompt_ids + self.output_ids
        self.params = params
        # Read for every row of every step: kept as plain attributes, not recomputed from the params each time.
        self.is_greedy = params.is_greedy
        self.has_penalties = params.has_penalties
        self.max_tokens = max_tokens
        # Ids that end this sequence: the checkpoint's eos (unless ignored) plus the request's own.
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        # Its row in the block manager's BlockTables while it runs (-1: none), and how many blocks that row holds.
        self.slot = -1
        self.slot_blocks = 0
        # Tokens whose K/V are already in the cache (prefix hits, earlier prefill chunks, decoded tokens).
        self.num_cached_tokens = 0
        # Leading blocks already registered for prefix caching (kept by the block manager).
        self.num_hashed_blocks = 0
        # Chain hashes of its leading full blocks, computed once by the block manager.
        self.block_hashes: list[bytes] = []
        # Prompt logprobs, filled by position as prefill chunks compute them; handed out with the first
        # output and dropped there (None once sent, or when not asked for).
        self.prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = (
            [None] * len(prompt_ids) if params.prompt_logprobs is not None else None)
        self.arrival = next(_arrival)
        # For the scheduler's admission order: times preempted, and later arrivals admitted while it waited.
        self.num_preemptions = 0
        self.num_bypassed = 0
        # Speculative decoding: the tokens proposed for this step (verified by it, then cleared), the
        # proposal length it adapts (set by the engine's speculator), and its own counts.
        self.draft: list[int] = []
        self.spec_k = 0
        # Steps left without proposals after verifications that took nothing, and how long the next such rest is.
        self.spec_rest = 0
        self.spec_next_rest = 0
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verify_steps = 0  # steps that verified proposals for it
        # Draft-model proposals: the distributions they were drawn from (sampled requests), and how many of
        # the sequence's tokens the draft model's KV cache holds (0 again after a preemption).
        self.draft_probs: torch.Tensor | None = None
        self.draft_computed = 0
        # Tokens sampled by steps still in flight (asynchronous scheduling): counted in the sequence's length
        # for scheduling, their ids not yet read back to token_ids.
        self.num_pending = 0
        self.pending_row = 0  # that token's row in the in-flight step's sampled ids
        # The seed of its random draws (executor/random_draws.py): the request's, else the one given, else a
        # fresh random one. Its draw counter starts after the outputs given, where an unbroken run's would be.
        self.seed = params.seed if params.seed is not None else seed if seed is not None else fresh_seed()
        # Re-added by the worker after its engine core restarted: admitted once already, so no queue limit refuses it.
        self.resumed = False
        # The structured-output matcher (executor/grammar.py's GrammarState), set by the engine; None: free text.
        self.grammar = None
        # Its LoRA adapter, set by the engine: the name ("" for the base model), the adapter's slot (-1: none), and
        # the digest its block hash chain starts from (worker.proto, LoadUpdate; None: the base model's chain).
        self.adapter = ""
        self.lora_slot = -1
        self.hash_root: bytes | None = None
        # A prompt-only request's PoolingParams (engine/pooling.py), set by the engine: its last prompt position
        # yields an embedding or some logits instead of a token, and it ends there. None: it generates.
        self.pooling = None

    def draw_key(self) -> tuple[int, int]:
        """(seed, counter) of the draw for its next output token: the counter is that token's index, tokens
        still in flight counted."""
        return self.seed, len(self.output_ids) + self.num_pending

    def __len__(self) -> int:
        """Its tokens, those still in flight included."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncached_tokens(self) -> int:
        return len(self) - self.num_cached_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None

    def take_prompt_logprobs(self) -> list | None:
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)
        if token_id in self.stop_ids:
            self.finish(FinishReason.EOS)
        elif self.grammar is not None and not self._grammar_accepts(token_id):
            self.finish(FinishReason.EOS)
        elif len(self.output_ids) >= self.max_tokens:
            self.finish(FinishReason.LENGTH)

    def _grammar_accepts(self, token_id: int) -> bool:
        """Advances the matcher; False when the grammar is complete (the output is whole: it ends as an eos
        would) or, which the mask should make impossible, refused the token."""
        if not self.grammar.accept(token_id):
            log.warning("request %s: the grammar refused token %d it had allowed", self.request_id, token_id)
            return False
        return not self.grammar.is_complete

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, prompt={len(self.prompt_ids)}, "
                f"output={len(self.output_ids)}, cached={self.num_cached_tokens})")
