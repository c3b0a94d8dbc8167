"""Everything one rank sets up before its first step: its device and rank group, the model, the KV cache, graphs."""
from __future__ import annotations

import logging
import pathlib

import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.model import Qwen3Config
from services.model_worker.distributed.group import RankGroup, Rendezvous, device_for_rank
from services.model_worker.distributed.parallel import local_config
from services.model_worker.executor.kv_cache import KVCache
from services.model_worker.executor.kv_sizing import blocks_from_budget, plan_kv_cache, profile_step_memory
from services.model_worker.executor.model_runner import ModelRunner
from services.model_worker.executor.sampler import Sampler
from services.model_worker.executor.step_channel import AdapterChange, StepChannel
from services.model_worker.kernels import cpu_argmax, cpu_decoder, cpu_norm, cpu_random_draws
from services.model_worker.model.fused_decode import use_activation_kernel, use_fused_decode
from services.model_worker.model.layers.linear import linear_layers
from services.model_worker.model.layers.quant.choose_method import linear_methods
from services.model_worker.model.layers.norm import use_norm_kernel
from services.model_worker.model.loader import load_model, resolve_device, resolve_dtype
from services.model_worker.model.lora.model_lora import LoraModel
from services.model_worker.model.lora.peft_folder import read_adapter

log = logging.getLogger(__name__)


class Executor:
    """One rank's model on its device, ready to step.

    Rank 0 is the engine's: under tensor parallelism it starts ranks 1..N-1 (rendezvous None) and
    hands them each step's inputs; each of those builds an Executor of its own with its Rendezvous
    and only runs forwards (executor/rank_process.py). The choices made for the device (weight
    format, CPU kernels, KV cache size, CUDA graphs) are made here, once.
    """

    def __init__(self, checkpoint_dir: str | pathlib.Path, config: EngineConfig, model_config: Qwen3Config,
                 rendezvous: Rendezvous | None = None):
        self.engine_config = config
        self.model_config = model_config
        tp_size = config.tensor_parallel_size
        device = resolve_device(config.device)
        self.group: RankGroup | None = None
        if tp_size > 1:
            device = device_for_rank(device, rendezvous.rank if rendezvous else 0)
        if device.type == "cuda":
            # Once, before anything runs: Triton launches, graph capture and synchronize() act on the
            # current device, which is cuda:0 unless set.
            torch.cuda.set_device(device)
        if tp_size > 1:
            self.group = (RankGroup.join(rendezvous, tp_size, device) if rendezvous
                          else RankGroup.launch(checkpoint_dir, config, device))
        tp = self.group.tp if self.group else None
        self.device = device
        self.dtype = resolve_dtype(config.dtype, model_config, device)
        linear = linear_methods(device, self.dtype, model_config.quantization_config, config.quantization,
                                config.quantize_lm_head, config.small_batch_kernel, config.pack_weights,
                                config.int8_activations, config.vnni_weights)
        self.model = load_model(checkpoint_dir, model_config, device, self.dtype, tp, config.huge_pages, linear.body,
                                linear.head)
        log.info("%d linear layers with %s weights", len(linear_layers(self.model)), linear.name)
        # Adapter slots before the KV cache is sized, so a GPU's profile counts them.
        self.lora = (LoraModel(self.model, config.max_loras, config.max_lora_rank, self.dtype, device)
                     if config.enable_lora else None)
        # This rank's share of the heads: what its KV cache holds.
        self.rank_config = local_config(model_config, tp_size)
        self._cpu_kernels(config)
        if config.fused_decode and self.model.model.fused_decode is None:
            self.close()  # other tensor-parallel ranks, if any, were started above
            raise ValueError("fused_decode needs bf16 on a CPU with AVX-512, the norm and small-batch kernels, "
                             "and one rank")
        num_blocks = self._num_blocks(model_config)
        on_cuda = device.type == "cuda"
        # CUDA graphs under tensor parallelism would capture NCCL all-reduces: untested, so eager there.
        graphs = on_cuda and not config.enforce_eager and tp_size == 1
        self.kv_cache = KVCache(self.rank_config, num_blocks, config.block_size, self.dtype, device,
                                spare_block=graphs, huge_pages=config.huge_pages,
                                kv_cache_dtype=config.kv_cache_dtype, fp8_scales=self._fp8_scales())
        self.runner = ModelRunner(self.model, self.kv_cache, device)
        self.runner.lora = self.lora
        self.max_model_len = min(self._max_len(model_config), num_blocks * config.block_size)
        log.info("KV cache: %d blocks of %d tokens (%.2f GB%s, %s); max context %d tokens", num_blocks,
                 config.block_size,
                 num_blocks * KVCache.bytes_per_block(self.rank_config, config.block_size, self.dtype,
                                                      config.kv_cache_dtype) / 1e9,
                 " per rank" if tp_size > 1 else "", str(self.kv_cache.dtype).removeprefix("torch."),
                 self.max_model_len)
        if graphs:
            self.runner.capture_graphs(config.limits.max_num_seqs, self.max_model_len)
        self.step_channel: StepChannel | None = None
        if self.group is not None:
            limits = config.limits
            self.step_channel = StepChannel(self.group.step_group, limits.max_num_batched_tokens,
                                            limits.max_num_seqs, -(-self.max_model_len // config.block_size))
            if rendezvous is None:
                self.runner.step_sender = self.step_channel.send
                if self.lora is not None:
                    self.lora.send_change = self.step_channel.send_adapter

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (rank 0)."""
        if self.group is not None:
            self.group.close(lambda: StepChannel(self.group.step_group, 0, 0, 0).stop())

    def serve_steps(self) -> None:
        """Ranks 1..N-1: run rank 0's steps until it says stop."""
        while (host := self.step_channel.receive()) is not None:
            if isinstance(host, AdapterChange):
                self._change_adapter(host)
                continue
            hidden = self.runner.forward(host)
            # Rank 0 projects every sampled row but the pooled ones that want hidden states (run_pooling).
            logit_rows = host.sample_rows.numel() - host.num_hidden_rows
            if logit_rows:
                self.model.compute_logits(hidden[:logit_rows])  # sends this rank's vocab slice to rank 0

    def _change_adapter(self, change: AdapterChange) -> None:
        """Ranks 1..N-1: rank 0's adapter slot change, into this rank's shards (rank 0 checked the folder)."""
        if change.path is None:
            self.lora.clear(change.slot)
        else:
            self.lora.write(change.slot, read_adapter(change.path, self.model_config, self.engine_config.max_lora_rank))

    def _cpu_kernels(self, config: EngineConfig) -> None:
        """The C kernels besides the linear layers' (their method was chosen before loading)."""
        if self.device.type != "cpu":
            return
        # Built now, not in the first request's step (the sampler finds them loaded).
        cpu_argmax.load()
        cpu_random_draws.load()
        if config.norm_kernel is not False:
            library = cpu_norm.load()
            if library is not None:
                use_norm_kernel(self.model, library)
        # decoder.c holds both the fused decode loop and the SiLU-and-product: loaded once for the two,
        # and only for bf16 activations, the only ones either takes.
        wanted = config.norm_kernel is not False or config.fused_decode is not False
        decoder = cpu_decoder.load() if wanted and self.dtype == torch.bfloat16 else None
        if decoder is not None and config.norm_kernel is not False:
            use_activation_kernel(self.model, decoder)
        if config.fused_decode is not False:
            use_fused_decode(self.model.model, decoder)

    def _fp8_scales(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's fp8 KV cache scales as loaded with the checkpoint (1.0 where it has none)."""
        return [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in self.model.model.layers]

    def _max_len(self, model_config: Qwen3Config) -> int:
        return min(model_config.max_position_embeddings,
                   self.engine_config.max_model_len or model_config.max_position_embeddings)

    def _num_blocks(self, model_config: Qwen3Config) -> int:
        """An explicit count, else what profiling leaves on a GPU, else the byte budget on a CPU; the
        same on every rank (each holds its own heads of every block)."""
        config = self.engine_config
        per_block = KVCache.bytes_per_block(self.rank_config, config.block_size, self.dtype, config.kv_cache_dtype)
        max_len = self._max_len(model_config)
        if config.num_blocks:
            num_blocks = config.num_blocks
        elif self.device.type == "cuda":
            # Run the largest step once, measure its peak, and give the cache what is left.
            memory = profile_step_memory(self.model, Sampler(), self.rank_config, self.device, self.dtype,
                                         config.block_size, config.limits, max_len, config.kv_cache_dtype)
            plan = plan_kv_cache(memory, config.gpu_memory_utilization, per_block, config.block_size,
                                 max_len, config.limits.max_num_seqs)
            log.info("%s", plan.summary)
            num_blocks = plan.num_blocks
        else:
            num_blocks = blocks_from_budget(config.kv_cache_bytes, per_block, max_len,
                                            config.block_size, config.limits.max_num_seqs)
        if self.group is not None:
            num_blocks = self.group.tp.min(num_blocks)
        return num_blocks
