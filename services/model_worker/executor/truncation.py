"""The top_k, top_p and min_p masks over temperature-scaled logits (their semantics: sampler.py's docstring).

The masked rows (those with a top_k, top_p or min_p; the others draw from their whole row) come back in
groups, each with its candidates: its tokens sorted by logit (the lower id first among equal ones), -inf where
masked out. Two ways to group, the same tokens kept either way:
  - batched (off the CPU): every masked row in one full-vocabulary sort; no host read, no per-row work,
    and no shape that depends on the values, so a step never waits for the device.
  - grouped (the CPU): rows with a top_k take a topk(k + 1), grouped by their own k (the k + 1-th value
    proves nothing outside is tied with the k-th), so no row's width depends on another row; rows with
    a tie there, or with top_p/min_p but no top_k, sort the vocabulary. Reading the tie check back is
    free on a CPU, and sorting 151,936 values per row is not.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.model_worker.executor.sampling_columns import Columns


@dataclass
class Group:
    rows: torch.Tensor  # (R,) int64: the group's rows among the sampled rows
    candidates: torch.Tensor  # (R, W) scaled logits, -inf where masked out
    ids: torch.Tensor  # (R, W) int64: their token ids


def truncate(scaled: torch.Tensor, columns: Columns, batched: bool) -> list[Group]:
    """The masked rows' groups. scaled: (S, V) float32, the sampled rows' logits over their temperatures.
    batched: the GPU's grouping on a CPU too (off the CPU it is the only one)."""
    if not columns.masked_rows:
        return []
    if batched or scaled.device.type != "cpu":
        values, ids = scaled[columns.masked].sort(dim=-1, descending=True, stable=True)
        return [Group(columns.masked, mask_sorted(values, *columns.masked_columns), ids)]
    return _grouped(scaled, columns)


def _grouped(scaled: torch.Tensor, columns: Columns) -> list[Group]:
    groups, sort_rows = [], list(columns.sorted_rows)
    for k, rows in columns.by_k.items():
        values, ids = scaled[columns.by_k_index[k]].topk(k + 1, dim=-1)  # sorted, largest first
        tied = (values[:, k] == values[:, k - 1]).tolist()  # a host read: this path runs on the CPU only
        sort_rows += [r for r, t in zip(rows, tied) if t]
        keep = [j for j, t in enumerate(tied) if not t]
        if keep:
            kept_rows = torch.tensor([rows[j] for j in keep])
            values, ids = _lower_ids_first(values[keep], ids[keep])
            width_k = torch.full((len(keep), 1), k)
            groups.append(Group(kept_rows, mask_sorted(values, width_k, columns.top_p_drop[kept_rows],
                                                       columns.min_p[kept_rows]), ids))
    if sort_rows:
        rows = torch.tensor(sort_rows)
        # Stable, so that among equal logits the lower token id ranks first.
        values, ids = scaled[rows].sort(dim=-1, descending=True, stable=True)
        masked = mask_sorted(values, columns.top_k[rows], columns.top_p_drop[rows], columns.min_p[rows])
        groups.append(Group(rows, masked, ids))
    return groups


def mask_sorted(
    values: torch.Tensor,  # (R, W) descending
    top_k: torch.Tensor,  # (R, 1) int64: the rank of the k-th token, at most W
    top_p_drop: torch.Tensor,  # (R, 1) float32: 1 - top_p
    min_p: torch.Tensor,  # (R, 1) float32
) -> torch.Tensor:
    """values with -inf on the tokens the masks drop."""
    kth = values.gather(1, top_k - 1)
    values = values.masked_fill(values < kth, float("-inf"))
    probs = values.softmax(dim=-1)
    # Mass of each token and all ranked below it: the ascending cumulative sum TopPLogitsWarper
    # takes, in the same order.
    tail_mass = probs.flip(-1).cumsum(dim=-1).flip(-1)
    drop = tail_mass <= top_p_drop
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False
    return values.masked_fill(drop, float("-inf"))


def _lower_ids_first(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorders topk's output so equal values rank by token id, as the stable full sort does
    (topk leaves the order of ties unspecified)."""
    ids, order = ids.sort(dim=-1)
    values, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order)


def masked_logits(scaled: torch.Tensor, columns: Columns, batched: bool = False) -> torch.Tensor:
    """(S, V): the scaled logits with -inf on every token a row cannot draw, laid out over the vocabulary."""
    out = torch.full_like(scaled, float("-inf"))
    if columns.plain_rows:
        out.index_copy_(0, columns.plain, scaled[columns.plain])
    for group in truncate(scaled, columns, batched):
        spread = torch.full((group.rows.shape[0], scaled.shape[1]), float("-inf"), device=scaled.device)
        out.index_copy_(0, group.rows, spread.scatter_(1, group.ids, group.candidates))
    return out

