"""A step with prompts runs its last layer's output projection and MLP on the rows it samples alone.

A prompt's rows before its last (and a chunk that does not end its prompt) are there for their keys and
values: the last layer's attention still writes every row's, and the rows the step reads come out as
when every row ran. The reference is the same engine with every row run to the end, and the
transformers model for the tokens.
"""
from __future__ import annotations

import pytest
import torch

from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.kernels import cpu_decoder
from services.model_worker.model.layers.attention import metadata
from tests.unit.test_fused_decode import (PROMPT_SHAPES, SCENARIOS, make_prompt_checkpoint, prompt_engine,
                                          staggered_hidden)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", params=list(PROMPT_SHAPES))
def checkpoint(request, tmp_path_factory):
    return make_prompt_checkpoint(tmp_path_factory.mktemp(f"last-layer-{request.param}"), request.param)


def every_row(monkeypatch) -> None:
    """Every row runs the last layer to its end, as before the rows were pruned."""
    monkeypatch.setattr(metadata, "_output_rows", lambda host, device: None)


def caches(engine: LLMEngine) -> list[torch.Tensor]:
    return [t.clone() for layer in engine.kv_cache.layers for t in layer]


@pytest.mark.parametrize("fused", [True, False], ids=["fused loop", "layer by layer"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_rows_a_step_reads_and_the_cache_are_those_of_every_row_run(checkpoint, scenario, fused,
                                                                         monkeypatch):
    budget, arrivals = SCENARIOS[scenario]
    kept = []  # (rows of the step, the rows it kept) of each step with prompts
    real_rows = metadata._output_rows

    def spy(host, device):
        rows = real_rows(host, device)
        if host.max_query_len > 1:
            kept.append((host.slot_mapping.numel(), None if rows is None else rows.tolist()))
        return rows

    if fused:
        real_layers = cpu_decoder.prompt_layers
        fused_keeps = []
        monkeypatch.setattr(cpu_decoder, "prompt_layers", lambda *args: fused_keeps.append(
            None if args[9] is None else args[9].tolist()) or real_layers(*args))
    with monkeypatch.context() as patch:
        patch.setattr(metadata, "_output_rows", spy)
        pruned_engine = prompt_engine(checkpoint, fused, budget)
        pruned = staggered_hidden(pruned_engine, arrivals, 5)
    if fused:
        assert fused_keeps == [rows for _, rows in kept]  # the C loop got each step's rows
    if scenario == "fresh prompts together":
        assert kept == [(94, [4, 21, 53, 93])]  # each prompt's last row of 5 + 17 + 32 + 40
    elif scenario == "chunked beside decodes":
        assert (24, []) in kept  # a chunk that does not end its prompt: no row reads past the last layer's attention
        assert any(rows and len(rows) < n for n, rows in kept)
    else:
        assert kept[0] == (27, [26]) and kept[-1][1] is not None
    with monkeypatch.context() as patch:
        every_row(patch)
        whole_engine = prompt_engine(checkpoint, fused, budget)
        whole = staggered_hidden(whole_engine, arrivals, 5)
    assert len(pruned) == len(whole) and all(torch.equal(a, b) for a, b in zip(pruned, whole))
    assert all(torch.equal(a, b) for a, b in zip(caches(pruned_engine), caches(whole_engine)))


@pytest.mark.parametrize("bad", ["descending", "past the rows", "repeated", "negative"])
def test_the_c_loop_refuses_rows_it_cannot_keep_before_it_touches_anything(checkpoint, bad, monkeypatch):
    """Rows out of order, repeated or outside the step: refused (status -1) with hidden and the step untouched."""
    refused = []
    real = cpu_decoder.prompt_layers

    def spy(*args):
        hidden, keep = args[4], args[9]
        wrong = {"descending": keep.flip(0), "past the rows": torch.tensor([hidden.shape[0]]),
                 "repeated": keep[[0, 0]], "negative": torch.tensor([-1])}[bad].to(torch.int64).contiguous()
        before = hidden.clone()
        with pytest.raises(RuntimeError, match="status -1"):
            real(*args[:9], wrong)
        refused.append(torch.equal(before, hidden))
        return real(*args)

    monkeypatch.setattr(cpu_decoder, "prompt_layers", spy)
    budget, arrivals = SCENARIOS["fresh prompts together"]
    staggered_hidden(prompt_engine(checkpoint, True, budget), arrivals, 2)
    assert refused == [True]
