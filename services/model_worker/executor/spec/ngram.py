"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

No second model: it pays where the output repeats spans of its own context (editing a given text,
answering from a given document, code), and proposes nothing elsewhere, which costs nothing.
"""
from __future__ import annotations

import numpy
from numpy.lib.stride_tricks import sliding_window_view


def propose(token_ids: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens, or [] where no suffix of ngram_max down to ngram_min tokens occurred before.

    The longest matching suffix wins (it is the best evidence); among its occurrences, the latest one
    that is followed by k tokens, else the latest (the context nearest the end is the likeliest to recur).
    """
    length = len(token_ids)
    if k < 1 or length < ngram_min + 1:
        return []
    tokens = numpy.asarray(token_ids, dtype=numpy.int64)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # Windows that start at 0 .. length-1-n: each is followed by at least one token.
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = numpy.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if not hits.size:
            continue
        full = hits[hits + n + k <= length]
        start = int(full[-1] if full.size else hits[-1]) + n
        return tokens[start:start + k].tolist()
    return []
