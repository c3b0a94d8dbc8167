"""The draft-model proposer: a smaller checkpoint with the target's vocabulary runs k cheap decode steps.

It keeps its own paged KV cache (its own layers, heads and dtype) laid out over the target's block
ids: a sequence's block table addresses both caches, so the scheduler's one allocation serves the
draft too and nothing is freed twice. Each sequence remembers how many of its tokens the draft has
computed (`draft_computed`); a step first catches the draft up on the tokens since (the last emitted
token, or the whole sequence the first time and after a preemption), batched over the sequences as
one prefill-style forward, then runs its k - 1 further decode steps batched. A block shared through
the prefix cache is rewritten with the same values when a second sequence catches up over it.
"""
from __future__ import annotations

import torch

from services.model_worker.config.sampling import SamplingParams
from services.model_worker.executor import random_draws
from services.model_worker.executor.model_runner import ModelRunner
from services.model_worker.executor.sampler import probabilities
from services.model_worker.executor.step_inputs import StepInputs


class DraftProposer:
    def __init__(self, runner: ModelRunner, block_size: int):
        self.runner = runner
        self.block_size = block_size

    def propose(self, token_ids: list[list[int]], computed: list[int], counts: list[int],
                block_tables: list[list[int]], params: list[SamplingParams],
                draws: list[tuple[int, int]]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per sequence: `counts[i]` proposed tokens, and for a sampled sequence the (count, V) distributions
        they were drawn from (None for greedy: its proposals are the draft's argmax).

        token_ids: each sequence's tokens; computed: how many of them the draft's cache holds; draws: its
        seed and the index of the output token its first proposal is for (proposal j: stream DRAFT's draw
        at that index + j).
        """
        rows = list(range(len(token_ids)))
        proposals: list[list[int]] = [[] for _ in rows]
        dists: list[list[torch.Tensor]] = [[] for _ in rows]
        new = [tokens[start:] for tokens, start in zip(token_ids, computed)]
        lengths = [len(tokens) for tokens in token_ids]
        for j in range(max(counts)):
            rows = [i for i in rows if counts[i] > j]
            host = StepInputs.build([new[i] for i in rows], [block_tables[i] for i in rows],
                                    [lengths[i] for i in rows], self.block_size)
            logits = self.runner.run(host).float()
            greedy = logits.argmax(dim=-1).tolist()
            sampled = [n for n, i in enumerate(rows) if not params[i].is_greedy]
            if sampled:
                probs = probabilities(logits[sampled], [params[rows[n]] for n in sampled])
                words = random_draws.draw_words([(draws[rows[n]][0], draws[rows[n]][1] + j) for n in sampled],
                                                random_draws.DRAFT, logits.device)
                noise = random_draws.exponential(words, torch.arange(probs.shape[1], device=logits.device))
                drawn = (probs / noise).argmax(dim=-1).tolist()
                for n, p, token in zip(sampled, probs, drawn):
                    greedy[n] = token
                    dists[rows[n]].append(p)
            for n, i in enumerate(rows):
                proposals[i].append(greedy[n])
                new[i] = [greedy[n]]
                lengths[i] += 1
        return proposals, [torch.stack(d) if d else None for d in dists]
