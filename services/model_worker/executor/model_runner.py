"""One step's forward: a step's inputs in, the hidden states or logits of the rows to sample out."""
from __future__ import annotations

from collections.abc import Callable

import torch

from services.model_worker.executor.cuda_graphs import DecodeGraphs
from services.model_worker.executor.kv_cache import KVCache
from services.model_worker.executor.step_inputs import StepInputs
from services.model_worker.model.layers.attention.backend import AttentionBackend
from services.model_worker.model.layers.attention.device_backend import default_backend
from services.model_worker.model.layers.attention.metadata import AttentionMetadata
from services.model_worker.model.lora.model_lora import LoraModel
from services.model_worker.model.qwen3 import Qwen3ForCausalLM


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, kv_cache: KVCache, device: torch.device,
                 attention: AttentionBackend | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.attention = attention or default_backend(device)
        self.graphs: DecodeGraphs | None = None
        # Tensor parallelism, rank 0: hands each step's inputs to the other ranks, which run the same forward.
        self.step_sender: Callable[[StepInputs], None] | None = None
        # The model's LoRA slots (model/lora/model_lora.py) where adapters are enabled.
        self.lora: LoraModel | None = None

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Decode steps replay CUDA graphs from now on; the cache's spare block takes the padding rows."""
        assert self.kv_cache.pad_block is not None, "the KV cache needs a spare block for padding rows"
        width = -(-max_model_len // self.kv_cache.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_cache.layers, self.attention, self.device, max_num_seqs,
                                   width, self.kv_cache.block_size, self.kv_cache.pad_block)
        with torch.inference_mode():
            self.graphs.capture()

    @torch.inference_mode()
    def run(self, host: StepInputs, previous_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """The logits of the rows to sample, (S, vocab) on rank 0; None when no row is sampled this step.

        In the model's dtype: greedy argmax reads them as they are (widening would not change the
        winner), and the sampler widens to float32 where it computes (penalties, sampling,
        logprobs). 16 rows of bf16 logits widened were 14.6 MB of memory traffic a step.

        previous_ids: the token ids the step before sampled, still on the device, where host.fill_rows needs them.
        """
        hidden = self.forward(host, previous_ids)
        if not host.sample_rows.numel():
            return None
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run_pooling(self, host: StepInputs, previous_ids: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """run's logits for all but the last host.num_hidden_rows rows (None if none), and those rows' final
        hidden states, (M, hidden): an embedding needs no vocabulary projection."""
        hidden = self.forward(host, previous_ids)
        split = hidden.shape[0] - host.num_hidden_rows
        return (self.model.compute_logits(hidden[:split]) if split else None), hidden[split:]

    def forward(self, host: StepInputs, previous_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of the rows to sample, (S, hidden): replayed from a graph where one fits."""
        if self.step_sender is not None:
            assert host.fill_rows is None, "tensor-parallel ranks get every input id from the host"
            self.step_sender(host)
        if host.lora_slots is not None and self.lora is not None:
            # Captured graphs hold no LoRA: a step with adapter rows runs eagerly.
            self.lora.begin_step(host.lora_slots)
            try:
                return self._eager(host, previous_ids)
            finally:
                self.lora.end_step()
        bucket = self.graphs.bucket_for(host) if self.graphs else None
        if bucket is not None:
            padded = _filled(host.padded(bucket, self.graphs.table_width, self.kv_cache.pad_block,
                                         self.kv_cache.block_size).to(self.device), previous_ids)
            return self.graphs.replay(padded)[padded.sample_rows]
        return self._eager(host, previous_ids)

    def _eager(self, host: StepInputs, previous_ids: torch.Tensor | None) -> torch.Tensor:
        inputs = _filled(host.to(self.device), previous_ids)
        meta = AttentionMetadata.from_inputs(inputs, host, self.kv_cache.block_size, self.attention)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, meta)
        return hidden[inputs.sample_rows]


def _filled(inputs: StepInputs, previous_ids: torch.Tensor | None) -> StepInputs:
    """The inputs with the previous step's sampled ids copied into their placeholder rows, on the device."""
    if inputs.fill_rows is not None:
        inputs.input_ids.index_copy_(0, inputs.fill_rows, previous_ids.index_select(0, inputs.fill_from))
    return inputs
