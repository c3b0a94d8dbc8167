"""Batched next-token sampling with per-sequence parameters, run once per decode step.

Per row, in this order (transformers' order for the same settings; the bias first, as in vLLM):
  0. logit_bias: each listed token's bias added to its logit,
  1. repetition_penalty over the set of prompt + output tokens (RepetitionPenaltyLogitsProcessor:
     logit * p where logit < 0, else logit / p),
  2. presence/frequency penalties over output tokens only (OpenAI:
     logit -= frequency * count + presence * (count > 0)),
  3. greedy rows: argmax (the lowest token id among equal maxima); other rows:
  4. temperature, then the top_k, top_p and min_p masks (TopK/TopP/MinPLogitsWarper semantics),
     then a draw.

Mask semantics:
  - top_k keeps every token whose logit is >= the k-th largest, so tokens tied with the k-th are all
    kept (transformers and vLLM do the same). k <= 0 or k >= vocab is off.
  - top_p keeps the smallest set of most likely tokens whose probability (after top_k) sums to
    >= top_p: a token is dropped when the mass of it and of every token ranked below it is
    <= 1 - top_p (TopPLogitsWarper's test, on the same ascending cumulative sum). The most likely
    token is always kept. Among equally likely tokens straddling the cut, lower token ids rank
    first (kept first).
  - min_p drops tokens whose probability is < min_p * (the top token's probability), after
    temperature, top_k and top_p, as MinPLogitsWarper applied last. Renormalizing after top_p scales
    every probability alike, so the test is done on the post-top_k probabilities.

The histories penalties read come as device rows, the seen set and the output counts of the penalised rows
alone (penalty_state.py): the engine keeps them per slot and adds each step's tokens on the device.

Logprobs (the chosen token's and the top N) come from log_softmax of the raw logits, before
penalties, temperature and masks, as in vLLM's default: they describe the model, not the sampler.

Reproducibility: a row's token depends only on its logits, its params and its draw key (its sequence's
seed and the index of the output token being drawn), never on the other rows, its position or the batch
size. The draw is the exponential race: argmax over tokens of p_t / E_t with E_t ~ Exp(1) independent per
token, an exact draw from p. E_t is a counter-based hash of (seed, index, stream, t) (random_draws.py), so
the same seed and request give the same tokens (OpenAI's seed) alone or in any batch, and a stream can
resume on another worker from its seed and its output length. p_t enters as exp(logit_t - max): the row's
normalizer does not move the argmax, and leaving it out keeps every sum over the row out of the draw, so
the width a row's candidates are laid out at (the vocabulary, sorted or not, or a top_k cut) never changes
its token.

No host sync and no per-row launch: sample() returns device tensors (read back by to_host()); the params
become device columns once per batch composition (sampling_columns.py), reused while the same rows come
back in the same order; off the CPU every masked row goes through one sort (truncation.py). On the CPU the race
is one C pass over each row (random_draws.race), reading bf16 logits and dividing by the temperature itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.model_worker.config.sampling import SamplingParams
from services.model_worker.executor import random_draws
from services.model_worker.executor.penalty_state import PenaltyRows
from services.model_worker.executor.sampling_columns import Columns
from services.model_worker.executor.truncation import masked_logits, truncate
from services.model_worker.kernels import cpu_argmax

DrawKey = tuple[int, int]  # (seed, index of the output token drawn): Sequence.draw_key()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's; None when not asked
    # (token_id, logprob), best first; [] when not asked
    top_logprobs: list[list[tuple[int, float]]]


class Sampler:
    def __init__(self, batched: bool = False):
        # Off the CPU the masks always run batched (truncation.py); True runs that path on a CPU too.
        self.batched = batched
        self._columns: Columns | None = None

    def __call__(
        self,
        logits: torch.Tensor,  # (B, V), any float dtype
        params: list[SamplingParams],
        penalties: PenaltyRows | None,  # the penalised rows' histories; None when no row has penalties
        draws: list[DrawKey | None],  # per row; None: a fresh random key
    ) -> SamplerOutput:
        return self.sample(logits, params, penalties, draws).to_host()

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        penalties: PenaltyRows | None,
        draws: list[DrawKey | None],
    ) -> "SampledBatch":
        """The draws as device tensors, read back later (to_host): the next step can take its input ids from
        token_ids on the device while this one's are still on their way to the host."""
        columns = self.columns(params, logits.shape[1], logits.device)
        if not columns.sampled_rows and not columns.adjusts:
            # The common case, every step: argmax in the logits' own dtype (widening is exact).
            return _with_logprobs(logits, columns, cpu_argmax.argmax(logits))
        # The race reads bf16 itself; penalties and masks work in float32.
        scores = penalise(logits.float(), columns, penalties) if columns.adjusts else logits
        if not columns.sampled_rows:
            return _with_logprobs(logits, columns, cpu_argmax.argmax(scores))
        words = random_draws.draw_words([draws[i] for i in columns.sampled_rows], random_draws.SAMPLE,
                                        logits.device)
        if columns.all_sampled:
            token_ids = _draw(scores, columns, words, self.batched)
        else:
            drawn = _draw(scores[columns.sampled], columns, words, self.batched)
            token_ids = cpu_argmax.argmax(scores).index_copy_(0, columns.sampled, drawn)
        return _with_logprobs(logits, columns, token_ids)

    def columns(self, params: list[SamplingParams], vocab: int, device: torch.device) -> Columns:
        """The batch's columns: the last batch's while the same params objects come back in the same order."""
        if self._columns is None or not self._columns.matches(params, vocab, device):
            self._columns = Columns(params, vocab, device)
        return self._columns


def apply_penalties(
    logits: torch.Tensor,  # (B, V) float32; not modified
    params: list[SamplingParams],
    penalties: PenaltyRows | None,  # the penalised rows' histories (PenaltyRows.from_ids builds them from ids)
) -> torch.Tensor:
    """The logit bias, then repetition, presence and frequency penalties; rows without them come back
    unchanged."""
    return penalise(logits, Columns(params, logits.shape[1], logits.device), penalties)


def penalise(logits: torch.Tensor, columns: Columns, penalties: PenaltyRows | None) -> torch.Tensor:
    """apply_penalties over a batch's columns."""
    if not columns.adjusts:
        return logits
    if columns.bias is not None:
        rows, tokens, biases = columns.bias
        logits = logits.index_put((rows, tokens), biases, accumulate=True)
    if penalties is None:
        return logits
    # Over the penalised rows alone; in a row with only some penalties the others' factors (1 and 0) change
    # nothing, exactly. On a CPU each pass over (rows, vocab) costs milliseconds: the arithmetic works in
    # place on the tensors the gathers make.
    rows, slots = penalties.rows, penalties.slots
    scores = logits if rows is None else logits[rows]
    if columns.repeat_rows:
        penalty = columns.repetition if rows is None else columns.repetition[rows]
        penalised = torch.div(scores, penalty)
        torch.where(scores < 0, scores * penalty, penalised, out=penalised)
        scores = torch.where(penalties.seen.index_select(0, slots), penalised, scores, out=penalised)
    if columns.count_rows:
        frequency, presence = ((columns.frequency, columns.presence) if rows is None
                               else (columns.frequency[rows], columns.presence[rows]))
        counts = penalties.counts.index_select(0, slots)
        # presence * (count > 0) is presence * sign(count): counts are never negative. A term every row has
        # at 0 subtracts exact zeros: left out.
        if not any(p.presence_penalty for p in columns.params):
            scores = torch.sub(scores, counts.mul_(frequency), out=counts)
        elif not any(p.frequency_penalty for p in columns.params):
            scores = torch.sub(scores, counts.sign_().mul_(presence), out=counts)
        else:
            present = counts.sign().mul_(presence)
            scores = torch.sub(scores, counts.mul_(frequency), out=counts).sub_(present)
    return scores if rows is None else logits.index_copy(0, rows, scores)


def _draw(
    scores: torch.Tensor,  # (S, V) bf16 or float32: the sampled rows, penalties applied
    columns: Columns,
    words: torch.Tensor,  # (S, 3): the rows' draw words (random_draws.draw_words)
    batched: bool,
) -> torch.Tensor:
    token_ids = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    if columns.plain_rows:  # no mask: the race divides by the temperature as it reads each logit
        rows = columns.plain
        every = len(columns.plain_rows) == scores.shape[0]
        token_ids.index_copy_(0, rows, random_draws.race(scores if every else scores[rows], words[rows], None,
                                                         columns.temperature if every else columns.temperature[rows]))
    if columns.masked_rows:
        for group in truncate(scores / columns.temperature, columns, batched):
            choice = random_draws.race(group.candidates, words[group.rows], group.ids).unsqueeze(1)
            token_ids.index_copy_(0, group.rows, group.ids.gather(1, choice).squeeze(1))
    return token_ids


def probabilities(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(R, V) float32: the distribution each (non-greedy) row's draw is taken from, after temperature and
    the top_k, top_p and min_p masks; scores are the logits with penalties applied, as the draw gets them.
    Speculative decoding's rejection sampler verifies proposals against it."""
    columns = Columns(params, scores.shape[1], scores.device)
    masked = masked_logits(scores / columns.temperature, columns)
    return masked.softmax(dim=-1)


def logprobs_of(logits: torch.Tensor, params: list[SamplingParams], token_ids: torch.Tensor) -> SamplerOutput:
    """The chosen tokens with their logprobs and top logprobs, as the sampler reports them."""
    return _with_logprobs(logits, Columns(params, logits.shape[1], logits.device), token_ids).to_host()


def _with_logprobs(logits: torch.Tensor, columns: Columns, token_ids: torch.Tensor) -> "SampledBatch":
    rows = columns.logprob_rows
    if not rows:
        return SampledBatch(token_ids, columns.params, rows, 0, None)
    index = columns.logprob_index
    logprobs = logits[index].float().log_softmax(dim=-1)
    chosen_values = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(columns.top_n, dim=-1)
    # One read back for everything: float64 holds the float32 logprobs and the token ids exactly.
    packed = torch.cat((token_ids.double(), chosen_values.double(), top_values.double().flatten(),
                        top_ids.double().flatten()))
    return SampledBatch(token_ids, columns.params, rows, columns.top_n, packed)


@dataclass
class SampledBatch:
    """A step's draws, still on the device: the token ids and, for rows that asked, their logprobs."""
    token_ids: torch.Tensor  # (B,) int64
    params: list[SamplingParams]
    logprob_rows: list[int]  # rows that asked for logprobs
    top_n: int  # top logprobs computed for each of those rows (the most any asked for)
    packed: torch.Tensor | None  # float64: token ids, chosen logprobs, top values, top ids; None without logprobs

    def to_host(self) -> SamplerOutput:
        """Reads the draws back (on a GPU, waits for them)."""
        batch = self.token_ids.shape[0]
        chosen: list[float | None] = [None] * batch
        top: list[list[tuple[int, float]]] = [[] for _ in range(batch)]
        if self.packed is None:
            return SamplerOutput(token_ids=self.token_ids.tolist(), logprobs=chosen, top_logprobs=top)
        rows, n, packed = self.logprob_rows, self.top_n, self.packed.tolist()
        ids = [int(t) for t in packed[:batch]]
        chosen_values = packed[batch:batch + len(rows)]
        flat = packed[batch + len(rows):]
        top_values, top_ids = flat[:len(rows) * n], flat[len(rows) * n:]
        for j, i in enumerate(rows):
            chosen[i] = chosen_values[j]
            want = self.params[i].logprobs
            top[i] = [(int(t), v) for t, v in zip(top_ids[j * n:j * n + want], top_values[j * n:j * n + want])]
        return SamplerOutput(token_ids=ids, logprobs=chosen, top_logprobs=top)
