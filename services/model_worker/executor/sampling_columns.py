"""A batch's sampling parameters as row lists and device columns, built once per batch composition.

Everything here depends on the rows' SamplingParams alone (and the vocabulary size), so a decode batch whose
rows come back in the same order reuses it step after step: no per-row Python, no copies to the device.
Device columns are made on first use: an all-greedy batch makes none.
"""
from __future__ import annotations

import operator
from functools import cached_property

import torch

from services.model_worker.config.sampling import SamplingParams
from services.model_worker.executor.transfer import to_device


class Columns:
    def __init__(self, params: list[SamplingParams], vocab: int, device: torch.device):
        self.params = list(params)
        self.vocab = vocab
        self.device = device
        self.adjusts = any(p.adjusts_logits for p in params)
        self.repeat_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        self.count_rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        # Sampled (non-greedy) rows; the columns below are over them, in their order.
        self.sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        self.all_sampled = len(self.sampled_rows) == len(params)
        self._sampled = [params[i] for i in self.sampled_rows]
        cuts = [0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for p in self._sampled]
        self.plain_rows = [r for r, cut in enumerate(cuts) if not cut]
        self.masked_rows = [r for r, cut in enumerate(cuts) if cut]
        # The CPU's grouping: rows with a top_k by their k (a topk(k + 1) instead of a sort), then the others.
        self.by_k: dict[int, list[int]] = {}
        for r in self.masked_rows:
            if 0 < self._sampled[r].top_k < vocab:
                self.by_k.setdefault(self._sampled[r].top_k, []).append(r)
        self.sorted_rows = [r for r in self.masked_rows if not 0 < self._sampled[r].top_k < vocab]
        self.logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.top_n = min(max((params[i].logprobs for i in self.logprob_rows), default=0), vocab)

    def matches(self, params: list[SamplingParams], vocab: int, device: torch.device) -> bool:
        """Whether these are the same params objects in the same order (params are never changed in place)."""
        return (vocab == self.vocab and device == self.device and len(params) == len(self.params)
                and all(map(operator.is_, params, self.params)))

    # -- logit bias and penalties, over all rows ----------------------------------------------------

    @cached_property
    def bias(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(rows, token ids, biases), one entry per biased token; None without any."""
        pairs = [(i, t, b) for i, p in enumerate(self.params) for t, b in p.logit_bias]
        if not pairs:
            return None
        return (self._long([i for i, _, _ in pairs]), self._long([t for _, t, _ in pairs]),
                self._float([b for _, _, b in pairs]))

    @cached_property
    def repetition(self) -> torch.Tensor:
        return self._column([p.repetition_penalty for p in self.params])

    @cached_property
    def frequency(self) -> torch.Tensor:
        return self._column([p.frequency_penalty for p in self.params])

    @cached_property
    def presence(self) -> torch.Tensor:
        return self._column([p.presence_penalty for p in self.params])

    # -- sampled rows -------------------------------------------------------------------------------

    @cached_property
    def sampled(self) -> torch.Tensor:
        return self._long(self.sampled_rows)

    @cached_property
    def temperature(self) -> torch.Tensor:
        return self._column([p.temperature for p in self._sampled])

    @cached_property
    def top_k(self) -> torch.Tensor:
        """(S, 1) int64: each row's k as the width of its cut, the whole vocabulary where top_k is off."""
        return self._long([p.top_k if 0 < p.top_k < self.vocab else self.vocab for p in self._sampled]).unsqueeze(1)

    @cached_property
    def top_p_drop(self) -> torch.Tensor:
        # 1 - top_p formed in double, as transformers does, then compared in float32.
        return self._column([1.0 - p.top_p for p in self._sampled])

    @cached_property
    def min_p(self) -> torch.Tensor:
        return self._column([p.min_p for p in self._sampled])

    @cached_property
    def plain(self) -> torch.Tensor:
        return self._long(self.plain_rows)

    @cached_property
    def masked(self) -> torch.Tensor:
        return self._long(self.masked_rows)

    @cached_property
    def masked_columns(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """top_k, top_p_drop and min_p over the masked rows."""
        return self.top_k[self.masked], self.top_p_drop[self.masked], self.min_p[self.masked]

    @cached_property
    def by_k_index(self) -> dict[int, torch.Tensor]:
        return {k: self._long(rows) for k, rows in self.by_k.items()}

    # -- logprobs -----------------------------------------------------------------------------------

    @cached_property
    def logprob_index(self) -> torch.Tensor:
        return self._long(self.logprob_rows)

    def _long(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.long, self.device)

    def _float(self, values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, self.device)

    def _column(self, values: list[float]) -> torch.Tensor:
        return self._float(values).unsqueeze(1)
