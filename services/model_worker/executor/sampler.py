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

Logprobs (the chosen token's and the top N) come from log_softmax of the raw logits, before
penalties, temperature and masks, as in vLLM's default: they describe the model, not the sampler.

Reproducibility: a row's token depends only on its logits, its params and its generator, never
on the other rows or the batch size. Each sampled row draws V exponential variates from its own
generator (the default RNG when None), one per token id, and takes argmax(prob / noise), an exact
draw from `prob` (the exponential race). Rows go through per-row kernels whatever batch they sit
in, and no shape a row is computed at depends on another row's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.model_worker.config.sampling import SamplingParams
from services.model_worker.executor.transfer import to_device
from services.model_worker.kernels import cpu_argmax


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's; None when not asked
    # (token_id, logprob), best first; [] when not asked
    top_logprobs: list[list[tuple[int, float]]]


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,  # (B, V), any float dtype
        params: list[SamplingParams],
        prompt_ids: list[torch.Tensor],  # per row, 1-D int64 on logits.device
        output_ids: list[torch.Tensor],  # per row, 1-D int64, may be empty
        generators: list[torch.Generator | None],  # per row, on logits.device
    ) -> SamplerOutput:
        return self.sample(logits, params, prompt_ids, output_ids, generators).to_host()

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        prompt_ids: list[torch.Tensor],
        output_ids: list[torch.Tensor],
        generators: list[torch.Generator | None],
    ) -> "SampledBatch":
        """The draws as device tensors, read back later (to_host): the next step can take its input ids from
        token_ids on the device while this one's are still on their way to the host."""
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not sampled_rows and not any(p.adjusts_logits for p in params):
            # The common case, every step: argmax in the logits' own dtype (widening is exact).
            token_ids = cpu_argmax.argmax(logits)
        else:
            scores = apply_penalties(logits.float(), params, prompt_ids, output_ids)
            token_ids = cpu_argmax.argmax(scores)
            if sampled_rows:
                rows = to_device(sampled_rows, torch.long, logits.device)
                drawn = _sample(
                    scores[rows],
                    [params[i] for i in sampled_rows],
                    [generators[i] for i in sampled_rows],
                )
                token_ids = token_ids.index_copy(0, rows, drawn)
        return _with_logprobs(logits, params, token_ids)


def apply_penalties(
    logits: torch.Tensor,  # (B, V) float32; not modified
    params: list[SamplingParams],
    prompt_ids: list[torch.Tensor],
    output_ids: list[torch.Tensor],
) -> torch.Tensor:
    """The logit bias, then repetition, presence and frequency penalties; rows without them come back
    unchanged."""
    batch, vocab = logits.shape
    device = logits.device
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    if bias_rows:
        rows = [i for i in bias_rows for _ in params[i].logit_bias]
        tokens = [t for i in bias_rows for t, _ in params[i].logit_bias]
        biases = [b for i in bias_rows for _, b in params[i].logit_bias]
        logits = logits.index_put((to_device(rows, torch.long, device), to_device(tokens, torch.long, device)),
                                  to_device(biases, torch.float32, device), accumulate=True)
    repeat_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeat_rows:
        rows, tokens = _flat_indices(
            repeat_rows, [torch.cat((prompt_ids[i], output_ids[i])) for i in repeat_rows], device
        )
        seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        # A device tensor of Trues, not the Python True: index_put_ copies a host scalar to the GPU, and waits.
        seen[rows, tokens] = torch.ones_like(tokens, dtype=torch.bool)
        penalty = _column([p.repetition_penalty for p in params], device)
        penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(seen, penalised, logits)
    count_rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if count_rows:
        rows, tokens = _flat_indices(count_rows, [output_ids[i] for i in count_rows], device)
        counts = torch.zeros(batch, vocab, device=device)
        ones = torch.ones_like(tokens, dtype=counts.dtype)
        counts.index_put_((rows, tokens), ones, accumulate=True)
        frequency = _column([p.frequency_penalty for p in params], device)
        presence = _column([p.presence_penalty for p in params], device)
        logits = logits - frequency * counts - presence * (counts > 0)
    return logits


def _sample(
    scores: torch.Tensor,  # (R, V) float32, penalties applied
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    noise = _exponential_noise(scores.shape, generators, scores.device)
    token_ids = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    for rows, candidates, ids in _truncate(_scale(scores, params), params):
        rows_t = to_device(rows, torch.long, scores.device)
        row_noise = noise[rows_t] if ids is None else noise[rows_t].gather(1, ids)
        choice = candidates.softmax(dim=-1).div_(row_noise).argmax(dim=-1, keepdim=True)
        chosen = choice if ids is None else ids.gather(1, choice)
        token_ids[rows_t] = chosen.squeeze(1)
    return token_ids


def probabilities(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(R, V) float32: the distribution each (non-greedy) row's draw is taken from, after temperature and
    the top_k, top_p and min_p masks; scores are the logits with penalties applied, as _sample gets them.
    Speculative decoding's rejection sampler verifies proposals against it."""
    probs = torch.zeros_like(scores)
    for rows, candidates, ids in _truncate(_scale(scores, params), params):
        rows_t = to_device(rows, torch.long, scores.device)
        row_probs = candidates.softmax(dim=-1)
        if ids is None:
            probs[rows_t] = row_probs
        else:
            probs[rows_t] = torch.zeros_like(probs[rows_t]).scatter_(1, ids, row_probs)
    return probs


def logprobs_of(logits: torch.Tensor, params: list[SamplingParams], token_ids: torch.Tensor) -> SamplerOutput:
    """The chosen tokens with their logprobs and top logprobs, as the sampler reports them."""
    return _with_logprobs(logits, params, token_ids).to_host()


def _scale(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return logits / _column([p.temperature for p in params], logits.device)


def _truncate(
    logits: torch.Tensor, params: list[SamplingParams]
) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """Splits rows into groups, each (rows, candidate logits (R, W), their token ids (R, W) or None
    when W is the whole vocabulary), -inf on candidates that are masked out.

    Rows with a top_k take a cheap topk(k + 1) instead of sorting the vocabulary: the k + 1-th value
    proves nothing outside is tied with the k-th. Rows are grouped by their own k so the width a
    row is computed at never depends on another row; rows with a tie there, or with top_p/min_p but
    no top_k, sort the whole vocabulary. Checking for ties costs one device sync per distinct k, so
    on a GPU (where sorting the vocabulary is cheap and a sync is not) every masked row is sorted.
    """
    vocab = logits.shape[1]
    device = logits.device
    plain, full, by_k = [], [], {}
    for r, p in enumerate(params):
        has_top_k = 0 < p.top_k < vocab
        if has_top_k and device.type == "cpu":
            by_k.setdefault(p.top_k, []).append(r)
        elif has_top_k or p.top_p < 1.0 or p.min_p > 0.0:
            full.append(r)
        else:
            plain.append(r)
    groups = []
    if plain:
        groups.append((plain, logits[to_device(plain, torch.long, device)], None))
    for k, rows in by_k.items():
        values, ids = logits[rows].topk(k + 1, dim=-1)  # sorted, largest first
        tied = (values[:, k] == values[:, k - 1]).tolist()
        full.extend(r for r, t in zip(rows, tied) if t)
        keep = [j for j, t in enumerate(tied) if not t]
        if keep:
            kept_rows = [rows[j] for j in keep]
            values, ids = _lower_ids_first(values[keep], ids[keep])
            masked = _mask_sorted(values, [params[r] for r in kept_rows], k)
            groups.append((kept_rows, masked, ids))
    if full:
        # Stable, so that among equal logits the lower token id ranks first.
        values, ids = logits[to_device(full, torch.long, device)].sort(dim=-1, descending=True, stable=True)
        groups.append((full, _mask_sorted(values, [params[r] for r in full], None), ids))
    return groups


def _mask_sorted(
    values: torch.Tensor,  # (R, W) descending
    params: list[SamplingParams],
    width_k: int | None,  # every row's top_k when the width is k + 1; None for a full sort
) -> torch.Tensor:
    device = values.device
    width = values.shape[1]
    if width_k is None:
        k = [p.top_k if 0 < p.top_k < width else width for p in params]
    else:
        k = [width_k] * len(params)
    kth = values.gather(1, to_device(k, torch.long, device).unsqueeze(1) - 1)
    values = values.masked_fill(values < kth, float("-inf"))
    probs = values.softmax(dim=-1)
    # Mass of each token and all ranked below it: the ascending cumulative sum TopPLogitsWarper
    # takes, in the same order; 1 - top_p is formed in double first, as transformers does.
    tail_mass = probs.flip(-1).cumsum(dim=-1).flip(-1)
    drop = tail_mass <= _column([1.0 - p.top_p for p in params], device)
    drop |= probs < _column([p.min_p for p in params], device) * probs[:, :1]
    drop[:, 0] = False
    return values.masked_fill(drop, float("-inf"))


def _lower_ids_first(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorders topk's output so equal values rank by token id, as the stable full sort does
    (topk leaves the order of ties unspecified)."""
    ids, order = ids.sort(dim=-1)
    values, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order)


def _exponential_noise(
    shape: torch.Size, generators: list[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    noise = torch.empty(shape, device=device)
    default_rows = []
    for r, generator in enumerate(generators):
        if generator is None:
            default_rows.append(r)
        else:
            noise[r].exponential_(generator=generator)
    if default_rows:
        drawn = torch.empty(len(default_rows), shape[1], device=device).exponential_()
        noise[to_device(default_rows, torch.long, device)] = drawn
    # A zero draw would turn prob / noise into inf or nan; the smallest normal float is as likely.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def _with_logprobs(logits: torch.Tensor, params: list[SamplingParams], token_ids: torch.Tensor) -> "SampledBatch":
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return SampledBatch(token_ids, params, rows, 0, None)
    rows_t = to_device(rows, torch.long, logits.device)
    logprobs = logits[rows_t].float().log_softmax(dim=-1)
    chosen_values = logprobs.gather(1, token_ids[rows_t].unsqueeze(1)).squeeze(1)
    n = min(max(params[i].logprobs for i in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(n, dim=-1)
    # One read back for everything: float64 holds the float32 logprobs and the token ids exactly.
    packed = torch.cat((token_ids.double(), chosen_values.double(), top_values.double().flatten(),
                        top_ids.double().flatten()))
    return SampledBatch(token_ids, params, rows, n, packed)


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


def _flat_indices(
    rows: list[int], ids: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [t.numel() for t in ids]
    # output_size spares a device sync on cuda.
    row_index = torch.repeat_interleave(
        to_device(rows, torch.long, device),
        to_device(lengths, torch.long, device),
        output_size=sum(lengths),
    )
    return row_index, torch.cat(ids).to(device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device).unsqueeze(1)
