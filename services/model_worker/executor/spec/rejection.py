"""Rejection sampling of proposed tokens (Leviathan et al., 2023): the output has the target's distribution.

For proposal d drawn from q, accept it with probability min(1, p(d) / q(d)); on the first rejection
draw from the residual max(0, p - q), renormalized, and stop; if every proposal is accepted, draw one
more token from the target's distribution after the last. Each emitted token is then distributed
exactly as a plain draw from p would be, whatever the proposer. A deterministic proposer (prompt
lookup) is the case q = one-hot(d): accept with probability p(d), else draw from p with d removed.

Draws are the sequence's counter-based ones (executor/random_draws.py), keyed by the index of the output
token they decide, so a seeded request is reproducible: the uniform for the proposal at index n is stream
ACCEPT's at n, a residual draw RESIDUAL's, and the bonus token SAMPLE's, the draw a plain step makes for
that index. Residual and bonus draws use the exponential race, as the sampler does.
"""
from __future__ import annotations

import torch

from services.model_worker.executor import random_draws


def _draw(probs: torch.Tensor, key: tuple[int, int], stream: int) -> int:
    """One exact draw from a (V,) distribution: argmax(p / E) with E ~ Exp(1) i.i.d. per token."""
    words = random_draws.draw_words([key], stream, probs.device)
    noise = random_draws.exponential(words, torch.arange(probs.shape[0], device=probs.device))[0]
    return int((probs / noise).argmax())


def verify(
    target: torch.Tensor,  # (d + 1, V) float32: the target's distribution at each proposed position and after
    draft_ids: list[int],  # d proposed tokens
    draft_probs: torch.Tensor | None,  # (d, V) the proposer's distributions; None: a deterministic proposer
    key: tuple[int, int],  # the sequence's seed and the index of the output token the first proposal is for
) -> list[int]:
    """The tokens to emit: the accepted proposals, then one drawn token (a correction or the bonus)."""
    count = len(draft_ids)
    seed, index = key
    device = target.device
    uniform = []
    if count:
        words = random_draws.draw_words([(seed, index + j) for j in range(count)], random_draws.ACCEPT, device)
        uniform = random_draws.uniform(words, torch.zeros(1, dtype=torch.long, device=device))[:, 0].tolist()
    ids = torch.tensor(draft_ids, dtype=torch.long, device=device)
    p_at = target[torch.arange(count, device=device), ids].tolist() if count else []
    q_at = (draft_probs[torch.arange(count, device=device), ids].tolist() if draft_probs is not None
            else [1.0] * count)
    out: list[int] = []
    for j, token in enumerate(draft_ids):
        # u < p/q, written as u * q < p so a zero q (which the proposer never draws) cannot divide.
        if uniform[j] * q_at[j] < p_at[j]:
            out.append(token)
            continue
        if draft_probs is None:
            residual = target[j].clone()
            residual[token] = 0.0
        else:
            residual = (target[j] - draft_probs[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q to rounding: any draw from p is then exact
            residual = target[j]
        out.append(_draw(residual, (seed, index + j), random_draws.RESIDUAL))
        return out
    out.append(_draw(target[count], (seed, index + count), random_draws.SAMPLE))
    return out
