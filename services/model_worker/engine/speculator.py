"""Speculative decoding's engine side: which sequences get proposals and how many, how a step's rows are
verified, and the counts (docs/speculative-decoding.md).

A decoding sequence with proposals d_1..d_k runs k + 1 new tokens in one target forward (its last token,
then the proposals, laid out by the scheduler as k + 1 one-token rows, row j seeing the context up to its
own token), and all k + 1 rows are sampled. Row j's logits are the target's next-token logits after d_1..d_j, exactly
those a plain decode would have after emitting them, so:
  - greedy rows take the longest prefix of proposals equal to the argmax at each row, then the argmax of
    the first row that disagrees (or of the last row): token for token what plain decoding emits;
  - sampled rows go through the rejection sampler (executor/spec/rejection.py) against the same
    distribution the plain sampler draws from (penalties, temperature and masks applied per row, each row
    with the proposals before it in its history), which leaves the output's distribution unchanged.
The KV cache already holds the accepted proposals' keys and values; the rejected ones' slots lie past the
sequence's computed tokens, are never read, and are overwritten by the next step. Blocks taken only for
rejected proposals go back to the pool (BlockManager.trim), and prefix-cache hashes only ever cover
computed, accepted tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.model_worker.config.engine import SpeculativeConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.sequence import Sequence
from services.model_worker.executor.penalty_state import PenaltyRows
from services.model_worker.executor.sampler import Sampler, apply_penalties, logprobs_of, probabilities
from services.model_worker.executor.spec import ngram, rejection
from services.model_worker.executor.spec.draft import DraftProposer
from services.model_worker.executor.transfer import to_device


# The longest run of plain decode steps after refused proposals: at most one step in this many then
# verifies a proposal that is refused again (a verification costs 1.1-1.2 decode steps).
MAX_REST_STEPS = 32


@dataclass
class Emitted:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]]


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftProposer | None = None):
        self.config = config
        self.method = config.method
        self.draft = draft  # method "draft": the draft model's proposer
        self.num_proposed = 0  # tokens proposed and verified
        self.num_accepted = 0  # of which accepted
        self.num_verify_steps = 0  # sequence-steps that verified at least one proposal
        self.num_emitted = 0  # tokens those sequence-steps emitted (accepted + one each)

    # -- proposing ----------------------------------------------------------------------------------

    def propose(self, running: list[Sequence]) -> None:
        """Sets each decoding sequence's `draft` for the next step ([] where speculation does not pay)."""
        crowded = len(running) > self.config.disable_batch_size
        for seq in running:
            seq.draft = []
            # Decoding only (not mid-prefill); unseeded sequences decode plainly in a compute-bound batch.
            if seq.num_uncached_tokens != 1 or (crowded and seq.params.seed is None):
                continue
            # Under a grammar: not while the constraint waits for its start (a proposal could run across it).
            # Each verified row is masked by the grammar's state after the proposals before it, so a proposed
            # token the grammar refuses is rejected at its row; prompt lookup's are cut before that here.
            constrained = seq.grammar is not None
            if constrained and not seq.grammar.active:
                continue
            if seq.spec_rest:
                seq.spec_rest -= 1
                continue
            if not seq.spec_k:
                seq.spec_k = self.config.num_speculative_tokens
            # Never past max_tokens: the last step's own token comes on top of the proposals.
            k = min(seq.spec_k, seq.max_tokens - len(seq.output_ids) - 1)
            if k <= 0:
                continue
            if self.draft is not None:
                # Room only: the scheduler fits it to the step's budget and blocks, then fill() runs the draft.
                seq.draft = [0] * k
            else:
                seq.draft = ngram.propose(seq.token_ids, k, self.config.ngram_min, self.config.ngram_max)
                if constrained:
                    del seq.draft[seq.grammar.valid_prefix(seq.draft):]

    def fill(self, seqs: list[Sequence], num_draft: list[int]) -> None:
        """Method "draft", after scheduling (the blocks for the proposals exist now): the draft model's
        proposals for the sequences that kept room for some."""
        chosen = [(seq, d) for seq, d in zip(seqs, num_draft) if d]
        if self.draft is None or not chosen:
            return
        proposals, dists = self.draft.propose(
            [s.token_ids for s, _ in chosen], [min(s.draft_computed, len(s) - 1) for s, _ in chosen],
            [d for _, d in chosen], [s.block_table for s, _ in chosen], [s.params for s, _ in chosen],
            [s.draw_key() for s, _ in chosen])
        for (seq, _), tokens, dist in zip(chosen, proposals, dists):
            seq.draft, seq.draft_probs = tokens, dist
            seq.draft_computed = len(seq)  # and its first len(tokens) - 1 proposals, counted once accepted

    # -- verifying ----------------------------------------------------------------------------------

    def sample(self, sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence],
               num_draft: list[int]) -> list[list[Emitted]]:
        """Per sequence, the tokens its rows emit: logits holds, per sequence in order, num_draft[i] + 1 rows
        (a constrained sequence's already masked, each by the grammar's state after the proposals before it).
        """
        device = logits.device
        params: list[SamplingParams] = []
        outputs: list[list[int]] = []  # a penalised row's output ids, the proposals before it included
        owner: list[int] = []
        draws: list[tuple[int, int]] = []  # (seed, index of the output token drawn): row j, the next index + j
        for i, (seq, d) in enumerate(zip(seqs, num_draft)):
            seed, counter = seq.draw_key()
            for j in range(d + 1):
                params.append(seq.params)
                outputs.append(seq.output_ids + seq.draft[:j] if seq.has_penalties else [])
                owner.append(i)
                draws.append((seed, counter + j))
        vocab = logits.shape[1]

        def penalties(rows: list[int]) -> PenaltyRows | None:
            """The rows' histories, each row's output with the proposals before it."""
            return PenaltyRows.from_ids([params[r] for r in rows], [seqs[owner[r]].prompt_ids for r in rows],
                                        [outputs[r] for r in rows], vocab, device)

        # Rows the plain sampler decides: greedy ones, and every row of a sequence without proposals.
        starts = [0]
        for d in num_draft:
            starts.append(starts[-1] + d + 1)
        drawn_seqs = [i for i, (seq, d) in enumerate(zip(seqs, num_draft)) if d and not seq.params.is_greedy]
        drawn_rows = {r for i in drawn_seqs for r in range(starts[i], starts[i + 1])}
        plain_rows = [r for r in range(len(params)) if r not in drawn_rows]
        emitted: list[list[Emitted]] = [[] for _ in seqs]
        if plain_rows:
            rows_t = to_device(plain_rows, torch.long, device)
            out = sampler(logits[rows_t], [params[r] for r in plain_rows], penalties(plain_rows),
                          [draws[r] for r in plain_rows])
            per_row = {r: Emitted(out.token_ids[n], out.logprobs[n], out.top_logprobs[n])
                       for n, r in enumerate(plain_rows)}
            for i, (seq, d) in enumerate(zip(seqs, num_draft)):
                if i in drawn_seqs:
                    continue
                for j in range(d + 1):  # the longest prefix of proposals the target agrees with, then its own
                    row = per_row[starts[i] + j]
                    emitted[i].append(row)
                    if j == d or row.token_id != seq.draft[j]:
                        break
        for i in drawn_seqs:
            rows = list(range(starts[i], starts[i + 1]))
            rows_t = to_device(rows, torch.long, device)
            scores = apply_penalties(logits[rows_t].float(), [params[r] for r in rows], penalties(rows))
            target = probabilities(scores, [params[r] for r in rows])
            tokens = rejection.verify(target, seqs[i].draft[:num_draft[i]], seqs[i].draft_probs, seqs[i].draw_key())
            used = rows[:len(tokens)]
            out = logprobs_of(logits[to_device(used, torch.long, device)], [params[r] for r in used],
                              to_device(tokens, torch.long, device))
            emitted[i] = [Emitted(t, lp, top) for t, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs)]
        return emitted

    def record(self, seq: Sequence, num_draft: int, num_emitted: int) -> None:
        """Counts one verification, and adapts the sequence's proposal length to it."""
        if not num_draft:
            return
        accepted = min(num_emitted - 1, num_draft)
        self.num_proposed += num_draft
        self.num_accepted += accepted
        self.num_verify_steps += 1
        self.num_emitted += num_emitted
        seq.num_proposed += num_draft
        seq.num_accepted += accepted
        seq.num_verify_steps += 1
        seq.draft_probs = None
        if self.draft is not None:  # the draft's cache holds the accepted proposals it computed
            seq.draft_computed += min(accepted, num_draft - 1)
        if not self.config.fixed_k:
            # All taken: try one more next time; else propose one more than were taken.
            limit = self.config.num_speculative_tokens
            seq.spec_k = min(limit, num_draft + 1) if accepted == num_draft else max(1, accepted + 1)
            # A draft model's single proposal refused: the sequence decodes plainly for a while, longer after
            # each refusal in a row, so a draft that does not predict the model costs a draft step and a
            # verification now and then instead of every step (measured with a draft that predicted nothing:
            # 12.9 tok/s proposing one token every step against 20.4 plainly). Prompt lookup's proposals cost
            # no model step, and the text it looks up may start repeating any time: it does not rest.
            if accepted:
                seq.spec_next_rest = 0
            elif num_draft == 1 and self.draft is not None:
                seq.spec_next_rest = min(MAX_REST_STEPS, max(1, 2 * seq.spec_next_rest))
                seq.spec_rest = seq.spec_next_rest

    def stats(self) -> dict[str, float]:
        return {"spec_proposed": self.num_proposed, "spec_accepted": self.num_accepted,
                "spec_acceptance_rate": self.num_accepted / self.num_proposed if self.num_proposed else 0.0,
                "spec_verify_steps": self.num_verify_steps,
                "spec_tokens_per_verify_step": self.num_emitted / self.num_verify_steps if self.num_verify_steps
                else 0.0}
