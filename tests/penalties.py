"""Hand-computed greedy decoding with presence and frequency penalties, on transformers' logits."""
from __future__ import annotations

import torch


def penalised_greedy(model, prompt: list[int], max_new_tokens: int, presence: float, frequency: float,
                     count_prompt: bool = False) -> list[int]:
    """Greedy tokens where each step's logits lose frequency * count + presence * (count > 0).

    Counts cover the generated tokens only (OpenAI's definition); count_prompt=True counts the
    prompt as well, the result a mix-up of the two histories would give.
    """
    out: list[int] = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        counted = (prompt + out) if count_prompt else out
        counts = torch.zeros_like(logits)
        for token in counted:
            counts[token] += 1
        scores = logits - frequency * counts - presence * (counts > 0).float()
        out.append(int(scores.argmax()))
    return out
