"""Decides which sequences run in each step, and how many of their tokens, under token and memory budgets."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rpcserver.errors import ResourceExhausted
from services.model_worker.config.engine import SchedulerLimits
from services.model_worker.engine.block_manager import BlockManager
from services.model_worker.engine.block_tables import BlockTables
from services.model_worker.engine.pooling import SCORE
from services.model_worker.engine.sequence import Sequence, SequenceStatus
from services.model_worker.executor.step_inputs import StepInputs


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # new tokens computed for each sequence this step, its proposed tokens included
    # Per sequence, how many of its new tokens are proposals to verify (its `draft`, after its own tokens);
    # empty when none has any.
    num_draft: list[int] = field(default_factory=list)
    # The pooling sequences whose last prompt chunk this step computes, in batch order: their last rows are pooled
    # (engine/pooling.py) instead of sampled.
    pooled: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    def step_inputs(self, tables: BlockTables) -> tuple[StepInputs, list[Sequence], list[tuple[Sequence, int, int]]]:
        """The step's flat inputs, the sequences that get a next token from it, and the prompt spans whose
        logprobs it computes: (sequence, first prompt position scored, count), their rows after the sampled ones.
        The pooled sequences' last rows come last: the scoring ones' among the logits rows, then the embedding
        ones' (host.num_hidden_rows), whose final hidden states are wanted instead.

        tables: the running sequences' block tables, a row per sequence (its slot)."""
        seqs = self.seqs
        if not self.num_draft and not self.pooled and max(self.num_tokens) == 1 and all(
                s.num_cached_tokens + 1 == len(s.token_ids) + s.num_pending for s in seqs):
            return self._decode_inputs(tables), seqs, []
        token_ids, slots, context_lens, extra_rows, spans = [], [], [], [], []
        sampled: list[int] = []  # entries of token_ids whose last row yields a next token
        sampled_seqs: list[Sequence] = []
        sampled_draft: list[int] = []
        # Rows whose token is still on the device (sampled by the step in flight), and its row there.
        fill_rows: list[int] = []
        fill_from: list[int] = []
        num_draft = self.num_draft or [0] * len(self.seqs)
        pooling = bool(self.pooled)
        score_rows: list[int] = []
        embed_rows: list[int] = []
        row = 0
        for i, (seq, n) in enumerate(zip(self.seqs, self.num_tokens)):
            start = seq.num_cached_tokens
            own = n - num_draft[i]
            if seq.num_pending:
                # Its one new token is the one the step in flight samples: a placeholder here, the sampled id
                # copied in on the device (a sequence waiting on the host is never scheduled this way).
                token_ids.append([0])
                slots.append(seq.slot)
                context_lens.append(start + 1)
                fill_rows.append(row)
                fill_from.append(seq.pending_row)
                sampled.append(len(token_ids) - 1)
                sampled_seqs.append(seq)
                sampled_draft.append(0)
                row += 1
                continue
            if num_draft[i]:
                # A verification (its one new token, then its proposals) goes in as that many one-token
                # rows, row j seeing the context up to its own token: causal attention over the proposals,
                # computed as decode rows are. The step stays a decode step wherever it has no prompt, so
                # it runs the fused decode loop (and, on a GPU, a captured graph) instead of the layers
                # one by one with prefill attention, which made a verification cost 1.5-1.7 decode steps.
                ids = seq.token_ids[start:start + own] + seq.draft[:num_draft[i]]
                token_ids.extend([t] for t in ids)
                slots.extend([seq.slot] * n)
                context_lens.extend(range(start + 1, start + n + 1))
                sampled.append(len(token_ids) - 1)  # its rows are then taken back from the last one
                sampled_seqs.append(seq)
                sampled_draft.append(num_draft[i])
                row += n
                continue
            token_ids.append(seq.token_ids[start:start + own])
            slots.append(seq.slot)
            context_lens.append(start + n)
            # A prompt prefilled in chunks yields a token only after its last chunk.
            if start + own == len(seq):
                if pooling and seq.pooling is not None:
                    (score_rows if seq.pooling.kind == SCORE else embed_rows).append(row + n - 1)
                else:
                    sampled.append(len(token_ids) - 1)
                    sampled_seqs.append(seq)
                    sampled_draft.append(0)
            if seq.wants_prompt_logprobs:
                # Position p's logits score prompt token p + 1: this chunk scores tokens start+1 .. up to the last.
                count = min(start + n, len(seq.prompt_ids) - 1) - start
                if count > 0:
                    extra_rows.extend(range(row, row + count))
                    spans.append((seq, start + 1, count))
            row += n
        host = StepInputs.build(token_ids, tables.gather(slots, max(context_lens)), context_lens, tables.block_size,
                                sampled, extra_rows + score_rows + embed_rows,
                                sampled_draft if self.num_draft else None)
        host.num_hidden_rows = len(embed_rows)
        return host.filled_from_previous(fill_rows, fill_from), sampled_seqs, spans


    def _decode_inputs(self, tables: BlockTables) -> StepInputs:
        """A step where every sequence computes its newest token and samples the next: a few values per sequence,
        the rest in tensors."""
        seqs = self.seqs
        context_lens = [s.num_cached_tokens + 1 for s in seqs]
        fill_rows = [i for i, s in enumerate(seqs) if s.num_pending]
        if fill_rows:  # their tokens are still on the device: placeholders, copied in there
            token_ids = [0 if s.num_pending else s.token_ids[-1] for s in seqs]
        else:
            token_ids = [s.token_ids[-1] for s in seqs]
        host = StepInputs.decode_from_tables(token_ids, tables, [s.slot for s in seqs], context_lens)
        return host.filled_from_previous(fill_rows, [seqs[i].pending_row for i in fill_rows])


class Scheduler:
    """Continuous batching: every running sequence advances each step; waiting ones join when they fit.

    Running sequences are served first, oldest first, so a new arrival never delays
    tokens already streaming. A prompt longer than the step's token budget is
    prefilled in chunks across steps. When the cache is full, the newest running
    sequence is preempted: its blocks are freed and it is recomputed later.

    Waiting prompts are admitted in arrival order (policy "fcfs"), or with "shortest-first" the one
    with the fewest tokens first. When prompts arrive together, the first token of each then waits
    only for the shorter ones: the median wait falls, and the last first token comes about when it
    would have anyway, once every prompt is computed. Preempted sequences, already streaming, go
    ahead of every new prompt, and a prompt overtaken by MAX_BYPASS later arrivals is admitted
    next, so a steady stream of short prompts cannot hold a long one back for ever.
    """

    MAX_BYPASS = 64

    def __init__(self, block_manager: BlockManager, limits: SchedulerLimits):
        self.block_manager = block_manager
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_computed_tokens = 0  # prompt and output tokens run through the model, for throughput logs
        self.num_pooling = 0  # pooling sequences waiting or running: while none, schedule() never looks for them

    def add(self, seq: Sequence) -> None:
        # A stream the worker carries on after its engine core restarted was admitted once: all of them come
        # back at once, and none is refused. A pooling call's inputs come together, the call counted as one
        # request by the worker (core/client.py): none of them is refused alone, nor counted here (running
        # ones are subtracted too, which errs on the side of admitting).
        if (not seq.resumed and seq.pooling is None
                and len(self.waiting) - self.num_pooling >= self.limits.max_waiting):
            raise ResourceExhausted(
                f"the worker's queue is full ({self.limits.max_waiting} requests waiting); retry later")
        self.waiting.append(seq)
        if seq.pooling is not None:
            self.num_pooling += 1

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.block_manager.free_blocks(seq)
                    if seq.pooling is not None:
                        self.num_pooling -= 1
                    return seq
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.limits.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        manager, block_size = self.block_manager, self.block_manager.block_size
        running = SequenceStatus.RUNNING
        # Once per sequence per step: kept to a few attribute reads for a decoding sequence that needs no new block.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not running:  # preempted below by an older sequence
                continue
            length = len(seq.token_ids) + seq.num_pending
            if seq.num_pending and len(seq.output_ids) + seq.num_pending >= seq.max_tokens:
                continue  # its token in flight is its last: it ends when that is read back
            wanted = min(length - seq.num_cached_tokens, budget)
            if length > len(seq.block_table) * block_size:
                while not manager.can_grow(seq):
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is seq:
                        break
                if seq.status is not running:
                    continue
            drafts = self._fit_draft(seq, budget - wanted) if seq.draft else 0
            if length + drafts > len(seq.block_table) * block_size:
                manager.grow(seq, drafts)
            batch.seqs.append(seq)
            batch.num_tokens.append(wanted + drafts)
            budget -= wanted + drafts
            if drafts:
                batch.num_draft += [0] * (len(batch.seqs) - 1 - len(batch.num_draft)) + [drafts]

        if self.waiting and budget and len(self.running) < self.limits.max_num_seqs:
            self._admit(batch, budget)
        if batch.num_draft:
            batch.num_draft += [0] * (len(batch.seqs) - len(batch.num_draft))
        if self.num_pooling:
            batch.pooled = [s for s, n in zip(batch.seqs, batch.num_tokens)
                            if s.pooling is not None and n == s.num_uncached_tokens]
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Waiting sequences join the batch, in admission order, while the budget, the sequence limit and
        the free blocks allow."""
        for seq in self._admission_order():
            if budget == 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            # Keep one free block per running sequence so admitting this one doesn't force a preemption next step.
            if not self.block_manager.can_allocate(seq, reserve=len(self.running)):
                break
            self.waiting.remove(seq)
            for other in self.waiting:
                if other.arrival < seq.arrival:
                    other.num_bypassed += 1
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            wanted = min(seq.num_uncached_tokens, budget)
            batch.seqs.append(seq)
            batch.num_tokens.append(wanted)
            budget -= wanted

    def _admission_order(self) -> list[Sequence]:
        if self.limits.policy == "fcfs":
            return list(self.waiting)

        def key(seq: Sequence) -> tuple:
            # Preempted (already streaming) and long-overtaken sequences first, in arrival order; then the
            # fewest tokens to compute, prefix-cache hits not counted.
            if seq.num_preemptions or seq.num_bypassed >= self.MAX_BYPASS:
                return (0, 0, seq.arrival)
            return (1, len(seq) - self.block_manager.num_prefix_hit_tokens(seq), seq.arrival)

        return sorted(self.waiting, key=key)

    def _fit_draft(self, seq: Sequence, budget: int) -> int:
        """How many of a decoding sequence's proposed tokens this step verifies: what the token budget and the
        free blocks allow (never a preemption for a proposal); the rest are dropped."""
        if not seq.draft or seq.num_uncached_tokens != 1:
            seq.draft = []
            return 0
        count = min(len(seq.draft), budget)
        while count and not self.block_manager.can_grow(seq, count):
            count -= 1
        del seq.draft[count:]
        return count

    def _preempt(self, seq: Sequence) -> None:
        seq.draft, seq.draft_computed = [], 0
        self.running.remove(seq)
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish_step(self, batch: ScheduledBatch) -> None:
        """Account for the computed tokens; release finished sequences."""
        self.account(batch)
        for seq in batch.seqs:
            if seq.is_finished:
                self.release(seq)

    def account(self, batch: ScheduledBatch) -> None:
        """The step's tokens are computed (or, on a device, queued to be): the next step starts after them."""
        manager, block_size = self.block_manager, self.block_manager.block_size
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_cached_tokens += n
            # A block may have filled (with tokens known here: one in flight is registered once read back).
            if min(seq.num_cached_tokens, len(seq.token_ids)) // block_size > seq.num_hashed_blocks:
                manager.commit(seq)
        self.num_computed_tokens += sum(batch.num_tokens)

    def release(self, seq: Sequence) -> None:
        """A finished sequence leaves the batch and gives its blocks back (a step still in flight that wrote
        to them is ordered before any later step that reuses them)."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free_blocks(seq)
            if seq.pooling is not None:
                self.num_pooling -= 1

    def may_preempt(self) -> bool:
        """Whether scheduling the running sequences' next tokens could run out of blocks and preempt one."""
        manager = self.block_manager
        wanted = 0
        for seq in self.running:
            wanted += max(0, manager.blocks_needed(len(seq)) - len(seq.block_table))
        return wanted > manager.num_free
