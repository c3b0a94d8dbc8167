"""The engine: load a checkpoint, accept requests, and advance every live sequence one step at a time."""
from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass

import torch

from rpcserver.errors import InvalidArgument
from services.model_worker.block_manager import BlockManager
from services.model_worker.config import GenerationDefaults, Qwen3Config
from services.model_worker.kv_cache import KVCache
from services.model_worker.loader import load_model, resolve_device, resolve_dtype
from services.model_worker.memory import plan_kv_cache
from services.model_worker.profile import profile_step_memory
from services.model_worker.model_runner import ModelRunner
from services.model_worker.kernels import cpu_argmax, cpu_linear, cpu_norm
from services.model_worker.fused_decode import use_fused_decode
from services.model_worker.optimize import (pack_linears, packing_supported, use_norm_kernel,
                                            use_small_batch_kernel)
from services.model_worker.parallel import check_divisible, local_config
from services.model_worker.ranks import RankGroup, Rendezvous, StepChannel, device_for_rank
from services.model_worker.sampler import Sampler
from services.model_worker.sampling_params import SamplingParams
from services.model_worker.scheduler import Scheduler, SchedulerLimits
from services.model_worker.sequence import FinishReason, Sequence
from services.model_worker.transfer import to_device

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    # KV cache size: an explicit block count, else bytes on CPU, else a fraction of free GPU memory.
    num_blocks: int | None = None
    kv_cache_bytes: int = 2 << 30
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Weights pre-packed for oneDNN at load time (same numerics, faster CPU matmuls), the vocab
    # projection included. None: on for CPU, off elsewhere; False gives tests the plain model.
    pack_weights: bool | None = None
    # bf16 on CPU: the matmuls of decode steps (up to 32 rows) in C kernels that stream the weights
    # near memory speed: AVX512-BF16 dot products for 1-2 rows (up to 4 without AMX), AMX tiles for
    # 3-32 where the CPU has AMX; the weights stay unpacked. Where it is used, packing is not. None: on where it
    # builds (a CPU with AVX512-BF16 and a C compiler).
    small_batch_kernel: bool | None = None
    # RMSNorm in a C kernel on CPU (same arithmetic, one call instead of about ten ops). None: where it builds.
    norm_kernel: bool | None = None
    # bf16 on CPU with both kernels above: every layer of a decode step in one C call
    # (fused_decode.py), the same arithmetic bit for bit. None: where it builds; False: layer by layer.
    fused_decode: bool | None = None
    # CPU: the weights and the KV cache on memory advised for 2 MiB pages (hugepages.py).
    huge_pages: bool = True
    # CUDA only: run decode steps eagerly instead of replaying captured CUDA graphs.
    enforce_eager: bool = False
    # Ranks (processes, one device each) the model is split across; rank 0 is the engine itself.
    tensor_parallel_size: int = 1
    limits: SchedulerLimits = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = SchedulerLimits()
        # Checked here, at start, with the flag's name: a bad value would otherwise surface later as a
        # division by zero, an empty cache or a cache larger than the machine.
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass
class StepOutput:
    request_id: str
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    finish_reason: FinishReason | None
    prompt_tokens: int


class LLMEngine:
    """The engine; under tensor parallelism, rank 0's engine starts the other ranks (rendezvous None),
    and each of those builds an engine of its own with its Rendezvous that only runs forwards (ranks.py)."""

    def __init__(self, checkpoint_dir: str | pathlib.Path, config: EngineConfig | None = None,
                 rendezvous: Rendezvous | None = None):
        self.engine_config = config = config or EngineConfig()
        self.checkpoint_dir = pathlib.Path(checkpoint_dir)
        self.config = Qwen3Config.from_json(self.checkpoint_dir)
        tp_size = config.tensor_parallel_size
        check_divisible(self.config, tp_size)
        self.generation = GenerationDefaults.from_dir(self.checkpoint_dir)
        # The offline demo checkpoint (demo/checkpoint.py) marks its config: its weights are random.
        self.is_demo_checkpoint = "vllm_v0_demo_checkpoint" in json.loads(
            (self.checkpoint_dir / "config.json").read_text())
        self.device = resolve_device(config.device)
        self.group: RankGroup | None = None
        if tp_size > 1:
            self.device = device_for_rank(self.device, rendezvous.rank if rendezvous else 0)
            self.group = (RankGroup.join(rendezvous, tp_size, self.device) if rendezvous
                          else RankGroup.launch(self.checkpoint_dir, config, self.device))
        tp = self.group.tp if self.group else None
        self.dtype = resolve_dtype(config.dtype, self.config, self.device)
        self.model = load_model(self.checkpoint_dir, self.config, self.device, self.dtype, tp, config.huge_pages)
        # This rank's share of the heads: what its KV cache holds.
        self.rank_config = local_config(self.config, tp_size)
        self._speed_up_cpu(config)
        if config.fused_decode and self.model.model.fused_decode is None:
            self.close()  # other tensor-parallel ranks, if any, were started above
            raise ValueError("fused_decode needs bf16 on a CPU with AVX-512, the norm and small-batch kernels, "
                             "and one rank")

        self.sampler = Sampler()
        on_cuda = self.device.type == "cuda"
        if config.num_blocks:
            num_blocks = config.num_blocks
        elif on_cuda:
            num_blocks = self._blocks_by_profiling()
        else:
            num_blocks = self._blocks_from_budget()
        if tp is not None:
            num_blocks = tp.min(num_blocks)  # every rank holds the same blocks (its own heads of them)
        # CUDA graphs under tensor parallelism would capture NCCL all-reduces: untested, so eager there.
        graphs = on_cuda and not config.enforce_eager and tp_size == 1
        self.kv_cache = KVCache(self.rank_config, num_blocks, config.block_size, self.dtype, self.device,
                                spare_block=graphs, huge_pages=config.huge_pages)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.limits)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        self.max_model_len = min(self._max_len(), num_blocks * config.block_size)
        self.eos_ids = frozenset(self.generation.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        log.info("KV cache: %d blocks of %d tokens (%.2f GB%s); max context %d tokens", num_blocks,
                 config.block_size,
                 num_blocks * KVCache.bytes_per_block(self.rank_config, config.block_size, self.dtype) / 1e9,
                 " per rank" if tp_size > 1 else "", self.max_model_len)
        if graphs:
            self.runner.capture_graphs(config.limits.max_num_seqs, self.max_model_len)
        self.step_channel: StepChannel | None = None
        if self.group is not None:
            limits = config.limits
            self.step_channel = StepChannel(self.group.step_group, limits.max_num_batched_tokens,
                                            limits.max_num_seqs, -(-self.max_model_len // config.block_size))
            if rendezvous is None:
                self.runner.step_sender = self.step_channel.send

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (rank 0)."""
        if self.group is not None:
            self.group.close()

    def _speed_up_cpu(self, config: EngineConfig) -> None:
        on_cpu = self.device.type == "cpu"
        if on_cpu:
            cpu_argmax.load()  # built now, not in the first request's step (the sampler finds it loaded)
        if on_cpu and config.norm_kernel is not False:
            library = cpu_norm.load()
            if library is not None:
                use_norm_kernel(self.model, library)
        if config.small_batch_kernel is not False and on_cpu and self.dtype == torch.bfloat16:
            library = cpu_linear.load()
            if library is not None:
                use_small_batch_kernel(self.model, library, cpu_linear.load_amx())
                if config.fused_decode is not False:
                    use_fused_decode(self.model.model)
                return
            if config.small_batch_kernel:
                raise ValueError("small_batch_kernel needs a C compiler and a CPU with AVX512-BF16")
        pack = config.pack_weights if config.pack_weights is not None else on_cpu
        if pack and packing_supported(self.device, self.dtype):
            pack_linears(self.model)

    def _max_len(self) -> int:
        return min(self.config.max_position_embeddings,
                   self.engine_config.max_model_len or self.config.max_position_embeddings)

    def _blocks_from_budget(self) -> int:
        """CPU: --kv-cache-bytes, at most what every sequence at full length could use."""
        per_block = KVCache.bytes_per_block(self.rank_config, self.engine_config.block_size, self.dtype)
        ceiling = self.engine_config.limits.max_num_seqs * -(-self._max_len() // self.engine_config.block_size)
        return max(min(self.engine_config.kv_cache_bytes // per_block, ceiling), 1)

    def _blocks_by_profiling(self) -> int:
        """CUDA: run the largest step once, measure its peak, and give the cache what is left."""
        config = self.engine_config
        memory = profile_step_memory(self.model, self.sampler, self.rank_config, self.device, self.dtype,
                                     config.block_size, config.limits)
        plan = plan_kv_cache(memory, config.gpu_memory_utilization,
                             KVCache.bytes_per_block(self.rank_config, config.block_size, self.dtype),
                             config.block_size, self._max_len(), config.limits.max_num_seqs)
        log.info("%s", plan.summary)
        return plan.num_blocks

    # -- requests -----------------------------------------------------------------------------------

    def make_params(self, overrides: dict) -> SamplingParams:
        """Sampling parameters from a request's set fields, defaults from generation_config.json."""
        params = SamplingParams.resolve(overrides, self.generation.sampling)
        params.validate(self.config.vocab_size)
        return params

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if request_id in self._seqs:
            raise InvalidArgument(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise InvalidArgument("prompt_token_ids is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidArgument(f"prompt_token_ids holds ids outside the vocabulary [0, {self.config.vocab_size}): "
                                  f"{bad[:5]}")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidArgument(f"the prompt has {len(prompt_ids)} tokens; this worker's context is "
                                  f"{self.max_model_len} tokens, which leaves no room to generate")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidArgument(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                  f"context of {self.max_model_len} tokens; lower max_tokens to at most {room}")
        seq = Sequence(request_id, prompt_ids, params, max_tokens, self.eos_ids, self.device)
        self.scheduler.add(seq)
        self._seqs[request_id] = seq
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(request_id)
        seq.finish(FinishReason.ABORTED)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- stepping -----------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        seqs, logits = self.runner.run(batch)
        outputs = []
        if seqs:
            # Token histories matter only to penalties; skip building them for the common case.
            none = torch.empty(0, dtype=torch.long, device=self.device)
            history = [(to_device(s.prompt_ids, torch.long, self.device),
                        to_device(s.output_ids, torch.long, self.device))
                       if s.params.has_penalties else (none, none) for s in seqs]
            sampled = self.sampler(logits, [s.params for s in seqs], [h[0] for h in history],
                                   [h[1] for h in history], [s.generator for s in seqs])
            for i, seq in enumerate(seqs):
                seq.append(sampled.token_ids[i])
                outputs.append(StepOutput(seq.request_id, sampled.token_ids[i], sampled.logprobs[i],
                                          sampled.top_logprobs[i], seq.finish_reason, len(seq.prompt_ids)))
        self.scheduler.finish_step(batch)
        for seq in seqs:
            if seq.is_finished:
                self._seqs.pop(seq.request_id, None)
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together; returns each one's generated ids (for tests and benchmarks)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{i}-{id(prompts)}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self._seqs for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].append(out.token_id)
        return [results[rid] for rid in ids]

    def stats(self) -> dict[str, float]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.block_manager.num_used,
            "kv_blocks_free": self.block_manager.num_free,
            "prefix_cache_hit_rate": self.block_manager.hit_rate,
            "preemptions": self.scheduler.num_preemptions,
        }
