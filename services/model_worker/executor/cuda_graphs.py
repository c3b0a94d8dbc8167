"""Decode steps replayed from CUDA graphs: one launch for the whole forward instead of hundreds.

At start the runner captures the decode forward once per batch-size bucket, reading its inputs
from static buffers. A decode step of n sequences pads its inputs to the smallest bucket >= n
(StepInputs.padded), copies them into the buffers and replays. Steps with prompt tokens, and
decode batches above the largest bucket, run eagerly.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from services.model_worker.executor.step_inputs import TENSOR_FIELDS, StepInputs
from services.model_worker.model.layers.attention.backend import AttentionBackend
from services.model_worker.model.layers.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (always included).

    Fine steps keep padding under 8 rows (a row costs little next to reading the weights); each
    bucket costs a capture at start and a little memory for its activations.
    """
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured batch size that holds num_seqs, or None (run eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    """Captured decode forwards, one per bucket, sharing one memory pool and one set of input buffers."""

    def __init__(self, model, kv_layers, backend: AttentionBackend, device: torch.device, max_num_seqs: int,
                 table_width: int, block_size: int, pad_block: int):
        self.model = model
        self.device = device
        self.kv_layers = kv_layers
        self.backend = backend
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.table_width = table_width
        self.block_size = block_size
        self.pad_block = pad_block
        # Inputs of the largest bucket; a smaller bucket's graph reads a prefix of each buffer.
        empty = StepInputs.build([[0]], [[pad_block]], [1], block_size)
        self.buffers = empty.padded(self.sizes[-1], table_width, pad_block, block_size).to(device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        start = time.monotonic()
        # Capture, its pool and its syncs act on the current device: name the worker's, never cuda:0 by default.
        with torch.cuda.device(self.device):
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool's memory
                self.model(*self._arguments(size))  # warm-up: Triton compiles, allocators settle
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.model(*self._arguments(size))
                self.graphs[size] = (graph, hidden)
            torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.sizes, time.monotonic() - start)

    def bucket_for(self, inputs: StepInputs) -> int | None:
        if inputs.max_query_len != 1:
            return None
        return bucket_for(inputs.num_seqs, self.sizes)

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """inputs: on the device, padded to a bucket. Returns the final hidden states (bucket, hidden)."""
        size = inputs.num_seqs
        for name in TENSOR_FIELDS[:-1]:  # sample_rows is the runner's business
            source = getattr(inputs, name)
            getattr(self.buffers, name)[tuple(slice(0, n) for n in source.shape)].copy_(source)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden

    def _arguments(self, size: int):
        b = self.buffers
        meta = AttentionMetadata(b.slot_mapping[:size], b.query_start_loc[:size + 1], b.context_lens[:size],
                                 b.block_tables[:size], self.block_size, 1, self.table_width * self.block_size,
                                 self.backend)
        return b.input_ids[:size], b.positions[:size], self.kv_layers, meta
