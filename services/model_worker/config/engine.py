"""The engine's settings, from the worker's flags: device, KV cache, CPU kernels, parallelism and scheduler limits."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


# --max-num-batched-tokens when not given, by device. A step's prompt tokens all get their first
# token only when the step ends, and every running stream waits for it. A CPU computes a 0.6B
# model's prompts at ~1,000 tokens/s, so a 2,048-token step holds first tokens and decodes for
# ~2 s; in shorter steps the earlier prompts of a queue get theirs sooner. Too short and the
# queue's last prompts wait behind more steps, each of which also decodes every running stream:
# 16 prompts of 32-512 tokens on one CPU, in process, got their first tokens at median / p90 ratios
# of 0.87 / 0.87 (3 rounds) and 0.74 / 0.66 (2 rounds) in 768-token steps against 512-token ones,
# with 1.08x the output throughput (bench/bench_load_ttft.py, docs/peers.md). A GPU's steps are
# short either way and gain from the larger batch.
CPU_STEP_TOKENS = 768
GPU_STEP_TOKENS = 2048


def default_step_tokens(device: str) -> int:
    """The step token budget for --device (auto, cpu, cuda, cuda:N) when none is given."""
    if device == "auto":
        import torch  # only for its view of the GPUs; the config is otherwise torch-free

        return GPU_STEP_TOKENS if torch.cuda.is_available() else CPU_STEP_TOKENS
    return CPU_STEP_TOKENS if device.startswith("cpu") else GPU_STEP_TOKENS


# The order waiting prompts are admitted in (Scheduler): fcfs, in arrival order; shortest-first, the fewest
# tokens first, so a burst's short prompts do not queue behind its long ones (with a bound on overtaking).
SCHEDULING_POLICIES = ("fcfs", "shortest-first")


@dataclass
class SchedulerLimits:
    max_num_seqs: int = 64              # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step: bounds how long a prefill chunk stalls decoding
    max_waiting: int = 256              # queued requests before new ones are refused
    policy: str = "shortest-first"      # the order waiting prompts are admitted in: SCHEDULING_POLICIES

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        # Otherwise a step could not give every running sequence its token.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs})")


SPECULATIVE_METHODS = ("ngram", "draft")

# --kv-cache-dtype: auto (the model's dtype) or an 8-bit cache; fp8_e4m3 is vLLM's name for fp8.
RUNNERS = ("auto", "generate", "pooling")  # --runner
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
KV_CACHE_ALIASES = {"fp8_e4m3": "fp8"}


@dataclass
class SpeculativeConfig:
    """Speculative decoding (docs/speculative-decoding.md); method None: off."""

    method: str | None = None
    num_speculative_tokens: int = 4  # the most tokens proposed per sequence and step
    # Prompt lookup: the longest suffix of ngram_max .. ngram_min tokens found earlier in the sequence.
    ngram_max: int = 4
    ngram_min: int = 2
    # False: k adapts per sequence to its recent acceptance (up to num_speculative_tokens); True: always k.
    fixed_k: bool = False
    # Above this many running sequences a step is compute-bound and verification costs more than it saves,
    # so unseeded sequences decode plainly (seeded ones keep speculating, so their draws never depend on load).
    disable_batch_size: int = 8
    draft_model: str | None = None  # method "draft": the smaller checkpoint's directory

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) and ngram_max ({self.ngram_max}) must satisfy "
                             "1 <= ngram_min <= ngram_max")
        if self.disable_batch_size < 1:
            raise ValueError(f"speculative_disable_batch_size must be >= 1, got {self.disable_batch_size}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative_method draft needs speculative_model (the draft checkpoint directory)")
        if self.method != "draft" and self.draft_model:
            raise ValueError("speculative_model is only read with speculative_method draft")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass
class EngineConfig:
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    # KV cache size: an explicit block count, else bytes on CPU, else a fraction of free GPU memory.
    num_blocks: int | None = None
    kv_cache_bytes: int = 2 << 30
    # The KV cache's element type: "auto" (the model's dtype), "fp8" (e4m3, a scale per layer) or "int8" (a scale
    # per token and KV head): half the bytes a token, so the same budget holds about twice the tokens
    # (docs/kv-cache.md). "fp8_e4m3" is taken as "fp8".
    kv_cache_dtype: str = "auto"
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
    # bf16 on a CPU with AMX, with the kernels above: each decoder weight reordered once, in place, into
    # the order AMX reads it, and every matmul of every row count in kernels/vnni_linear.c (prefill
    # chunks included: no plain copy is kept for oneDNN). The same bits as the AMX kernel on the plain
    # weights from 3 rows. None: where it builds; False: the plain weights; True: required.
    vnni_weights: bool | None = None
    # RMSNorm in a C kernel on CPU (same arithmetic, one call instead of about ten ops), and with it the
    # MLP's SiLU-and-product in one pass (decoder.c, bit for bit torch's). None: where they build.
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
    # 8-bit weights: "none", or quantize a bf16 checkpoint's linear layers when they load ("fp8": 128 x 128
    # blocks; "int8": a scale per output row). An fp8 checkpoint is served as fp8 whatever this says (but int8).
    quantization: str = "none"
    # The vocab projection in 8 bits too (a quarter of a 0.6B model's weight bytes); else it stays bf16.
    quantize_lm_head: bool = False
    # int8 weights on CPU in bf16: each matmul's input rows quantized to int8 too (one scale per row) and
    # multiplied in integers (AMX-INT8, or VNNI at a few rows); False keeps bf16 activations (q8_linear.c).
    int8_activations: bool = True
    # A structured-output grammar still compiling after this long fails its request (RESOURCE_EXHAUSTED). Compiles
    # run beside the steps and take milliseconds; the limit is for the schema built to take far longer.
    grammar_compile_timeout_s: float = 10.0
    # Schedule step N+1 and build its inputs while step N runs, its sampled ids feeding N+1 on the device and
    # read back one step late (llm_engine.py). Steps that need the host's view of the last tokens (grammars,
    # speculation, preemption, tensor parallelism) still wait for them. False: every step reads its own back.
    # None: on for CUDA only. A CPU runs each op where it is launched, so there nothing would overlap, and every
    # token would reach its client a step later.
    async_scheduling: bool | None = None
    # LoRA adapters (docs/lora.md): slots for max_loras adapters of rank up to max_lora_rank in every target layer,
    # allocated at start; lora_modules, (name, PEFT folder) pairs, are loaded at start.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    # What the worker serves (vLLM's --runner): "auto" generation and pooling (Embed, Score) alike, "generate"
    # generation only, "pooling" Embed and Score only (a worker kept for embeddings beside generating ones).
    runner: str = "auto"
    limits: SchedulerLimits = None  # type: ignore[assignment]
    speculative: SpeculativeConfig = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = SchedulerLimits()
        if self.speculative is None:
            self.speculative = SpeculativeConfig()
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
        self.kv_cache_dtype = KV_CACHE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization not in ("none", "fp8", "int8"):
            raise ValueError(f"quantization must be none, fp8 or int8, got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout_s}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        self._check_lora()

    def _check_lora(self) -> None:
        self.lora_modules = tuple((str(name), str(path)) for name, path in self.lora_modules)
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules needs --enable_lora")
            return
        names = [name for name, _ in self.lora_modules]
        if any(not name for name in names) or len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be non-empty and unique, got {names}")
        if len(names) > self.max_loras:
            raise ValueError(f"lora_modules names {len(names)} adapters, over --max_loras ({self.max_loras})")

    def to_dict(self) -> dict:
        """As JSON-ready data: how the config crosses to the engine core and to tensor-parallel ranks."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> EngineConfig:
        speculative = raw.get("speculative")
        return cls(**{**raw, "limits": SchedulerLimits(**raw["limits"]),
                      "speculative": SpeculativeConfig(**speculative) if speculative else None})
