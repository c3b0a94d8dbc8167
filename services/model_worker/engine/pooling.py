"""Prompt-only requests: what they yield at their last prompt position instead of a sampled token."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from rpcserver.errors import FailedPrecondition, InvalidArgument
from services.model_worker.config.sampling import SamplingParams

EMBED = "embed"  # the final hidden state (after the model's norm), L2-normalised
SCORE = "score"  # the raw logits of given token ids
# A checkpoint saved as a bare decoder without its head (model/loader.py; Qwen3-Embedding-4B and -8B are) has no
# logits to sample from or score with.
NO_HEAD = ("this checkpoint has no lm_head (a bare decoder saved for embeddings): it serves embeddings only, "
           "not generation or scores")
# A pooling sequence samples nothing; these keep it out of every sampling path (one "token", greedy, no
# penalties), and a max_tokens of 1 leaves no room for speculative proposals.
POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass(frozen=True)
class PoolingParams:
    """What a prompt-only request yields: its embedding, or the logits of `token_ids` (a reranker's "yes" and "no")."""

    kind: str
    dimensions: int | None = None   # embed: keep this many leading components, then normalise; None: all
    token_ids: tuple[int, ...] = ()  # score: the ids whose logits to return, in this order

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(self.token_ids))

    @classmethod
    def embed(cls, dimensions: int | None = None) -> PoolingParams:
        return cls(EMBED, dimensions=dimensions)

    @classmethod
    def score(cls, token_ids) -> PoolingParams:
        return cls(SCORE, token_ids=tuple(token_ids))

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self, vocab_size: int, hidden_size: int) -> None:
        """InvalidArgument naming what is out of range."""
        if self.kind == EMBED:
            if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
                raise InvalidArgument(f"dimensions must be in 1..{hidden_size} (the model's hidden size), "
                                      f"got {self.dimensions}")
        elif self.kind == SCORE:
            if not self.token_ids:
                raise InvalidArgument("token_ids is empty: give the ids whose logits to return")
            bad = [t for t in self.token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidArgument(f"token_ids holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        else:
            raise InvalidArgument(f"pooling kind must be {EMBED!r} or {SCORE!r}, got {self.kind!r}")


def check_served(has_lm_head: bool, runner: str, pooling: PoolingParams | None = None) -> None:
    """FailedPrecondition where this worker does not serve the request (pooling None: a generation): its --runner
    leaves that kind out, or it needs logits the checkpoint cannot give."""
    if pooling is None and runner == "pooling":
        raise FailedPrecondition("this model worker runs with --runner pooling: it serves Embed and Score, not "
                                 "generation")
    if pooling is not None and runner == "generate":
        raise FailedPrecondition("this model worker runs with --runner generate: it serves generation, not Embed or "
                                 "Score")
    if not has_lm_head and (pooling is None or pooling.kind != EMBED):
        raise FailedPrecondition(NO_HEAD)


def check_input(prompt_ids: list[int], vocab_size: int, max_model_len: int, name: str = "the input") -> None:
    """InvalidArgument unless the prompt is a non-empty run of vocabulary ids that fits the context (all of it:
    nothing is generated after it)."""
    if not prompt_ids:
        raise InvalidArgument(f"{name} is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{name} holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(prompt_ids) > max_model_len:
        raise InvalidArgument(f"{name} has {len(prompt_ids)} tokens; this worker's context is {max_model_len} tokens")


@dataclass(slots=True)
class PoolingOutput:
    request_id: str
    values: list[float]  # float32 values: the embedding (unit length), or the logits of token_ids in order
    prompt_tokens: int


def pool_rows(seqs: list, logits: torch.Tensor | None,
              hidden: torch.Tensor) -> tuple[list[PoolingOutput], torch.Tensor | None]:
    """The pooling sequences' outputs, and the logits without their rows.

    seqs: the step's pooling sequences in batch order; the scoring ones' rows are the last of `logits`, the
    embedding ones' final hidden states are `hidden`'s rows, each in that order (ScheduledBatch.step_inputs).
    """
    scored = [s for s in seqs if s.pooling.kind == SCORE]
    embedded = [s for s in seqs if s.pooling.kind == EMBED]
    outputs = []
    if scored:
        rows, logits = logits[-len(scored):], logits[:-len(scored)]
        for token_ids, members in _groups(scored, lambda p: p.token_ids):
            picked = rows[members][:, torch.tensor(token_ids, device=rows.device)]
            outputs += _outputs(scored, members, picked.float())
    if embedded:
        hidden = hidden.float()
        for dimensions, members in _groups(embedded, lambda p: p.dimensions):
            group = hidden[members]
            outputs += _outputs(embedded, members, F.normalize(group[:, :dimensions], dim=-1))
    return outputs, logits


def _groups(seqs: list, key) -> list[tuple[object, list[int]]]:
    """The sequences' indices grouped by a key of their pooling parameters: each group is one read from the device
    (one call's inputs all share theirs)."""
    groups: dict[object, list[int]] = {}
    for i, seq in enumerate(seqs):
        groups.setdefault(key(seq.pooling), []).append(i)
    return list(groups.items())


def _outputs(seqs: list, members: list[int], values: torch.Tensor) -> list[PoolingOutput]:
    return [PoolingOutput(seqs[i].request_id, row, len(seqs[i].prompt_ids)) for i, row in zip(members, values.tolist())]
