"""Prompt logprobs: each prompt token's log-probability given the tokens before it, from prefill rows."""
from __future__ import annotations

import torch

from services.model_worker.executor.transfer import to_device

# Rows widened to float32 at a time: a 2048-token chunk over Qwen3's 151,936-token vocabulary would
# otherwise take 1.2 GB of float32 at once.
ROWS_PER_PIECE = 256


def score_rows(
    logits: torch.Tensor,  # (E, V), any float dtype: row j's logits predict targets[j]
    targets: list[int],  # (E,) the prompt token each row scores
    top_n: list[int],  # (E,) how many best alternatives each row wants (0: none)
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row, (log_softmax(logits)[target], its top_n best (token id, logprob), best first).

    From the raw logits, as the generated tokens' logprobs are: no bias, penalty or temperature.
    """
    out: list[tuple[float, list[tuple[int, float]]]] = []
    width = min(max(top_n, default=0), logits.shape[1])
    for start in range(0, logits.shape[0], ROWS_PER_PIECE):
        stop = min(start + ROWS_PER_PIECE, logits.shape[0])
        logprobs = logits[start:stop].float().log_softmax(dim=-1)
        wanted = to_device(targets[start:stop], torch.long, logits.device).unsqueeze(1)
        chosen = logprobs.gather(1, wanted).squeeze(1)
        parts = [chosen.double()]
        if width:
            top_values, top_ids = logprobs.topk(width, dim=-1)
            parts += [top_values.double().flatten(), top_ids.double().flatten()]
        # One read back per piece: float64 holds the float32 logprobs and the token ids exactly.
        packed = torch.cat(parts).tolist()
        rows = stop - start
        values, ids = packed[rows:rows + rows * width], packed[rows + rows * width:]
        for j in range(rows):
            n = top_n[start + j]
            top = [(int(t), v) for t, v in zip(ids[j * width:j * width + n], values[j * width:j * width + n])]
            out.append((packed[j], top))
    return out
