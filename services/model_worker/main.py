"""python -m services.model_worker: load a Qwen3 checkpoint and serve ModelWorkerService."""
from __future__ import annotations

import argparse
import asyncio
import logging

from prometheus_client import REGISTRY

from checkpoint.path import resolve_model, served_model_name
from rpcserver.auth import add_auth_flags, auth_interceptors
from rpcserver.config import (SERVER_FLAG_RANGES, ServerConfig, add_flag, add_server_flags, check_ranges,
                              parse_size)
from rpcserver.handlers import add_servicer
from rpcserver.server import GrpcServer, setup_logging
from services.model_worker.config.engine import EngineConfig, SchedulerLimits, SpeculativeConfig
from services.model_worker.config.model import ConfigError
from services.model_worker.core.client import EngineClient
from services.model_worker.core.process import CoreStartError
from services.model_worker.config.engine import (CPU_STEP_TOKENS, GPU_STEP_TOKENS, RUNNERS, SCHEDULING_POLICIES,
                                                 default_step_tokens)
from services.model_worker.host import cpu_affinity
from services.model_worker.server.metrics import EngineCollector, observe_step
from services.model_worker.server.servicer import ModelWorkerServicer
from vllm_v0.worker.v1 import worker_pb2

log = logging.getLogger("model_worker")


class WorkerFailed(Exception):
    """The engine can no longer serve and will not be restarted (a tensor-parallel rank died)."""


def engine_cpus(text: str) -> frozenset[int] | None:
    """--engine-cpus: a CPU list this process may use, or None (empty: the worker's own CPUs)."""
    if not text:
        return None
    try:
        cpus = cpu_affinity.parse_cpu_list(text)
        cpu_affinity.check_available(cpus)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return cpus


def lora_module(text: str) -> tuple[str, str]:
    """--lora-modules name=path."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path (a PEFT adapter folder), got {text!r}")
    return name, path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.model_worker", description=__doc__.split(":", 1)[1])
    add_server_flags(parser, default_port=50053)
    add_flag(parser, "--model", "demo-model", "checkpoint directory, or a hub id such as Qwen/Qwen3-0.6B")
    add_flag(parser, "--device", "auto", "auto (cuda if present, else cpu), cpu, cuda or cuda:N")
    add_flag(parser, "--dtype", "auto", "auto, bfloat16, float16 or float32 (auto: the checkpoint's on GPU, "
             "bfloat16 on a CPU that supports it)")
    add_flag(parser, "--block-size", 16, "tokens per KV cache block")
    add_flag(parser, "--kv-cache-bytes", 2 << 30, "KV cache size on CPU: bytes, or a size such as 512MiB or 2GiB",
             type=parse_size)
    add_flag(parser, "--kv-cache-dtype", "auto", "the KV cache's element type: auto (the model's dtype), fp8 (e4m3, "
             "a scale per layer: the checkpoint's k_scale / v_scale, else 1.0) or int8 (a scale per token and KV head); "
             "8 bits hold about twice the tokens in the same memory and read half the bytes a decode step",
             choices=["auto", "fp8", "fp8_e4m3", "int8"])
    add_flag(parser, "--gpu-memory-utilization", 0.85, "fraction of the GPU's memory this worker may use: weights, "
             "the largest step's activations (measured at start) and the KV cache, which gets the rest")
    add_flag(parser, "--max-model-len", 0, "cap on prompt + completion tokens (0: the model's own limit)")
    add_flag(parser, "--max-num-seqs", 64, "most sequences decoded together in one step")
    add_flag(parser, "--max-num-batched-tokens", 0, "most tokens computed in one step (prefill chunk size; 0: "
             f"{CPU_STEP_TOKENS} on CPU, where a shorter step gives queued prompts their first tokens sooner, "
             f"{GPU_STEP_TOKENS} on a GPU)")
    add_flag(parser, "--max-waiting", 256, "most queued requests; beyond it requests get RESOURCE_EXHAUSTED")
    add_flag(parser, "--scheduling-policy", "shortest-first", "the order waiting prompts are admitted in: "
             "shortest-first (the fewest tokens to compute first, cached prefixes not counted; a prompt overtaken "
             "by 64 later arrivals goes next) or fcfs (arrival order). Under a burst, shortest-first gives most "
             "requests their first token sooner; the last one waits about as long", choices=SCHEDULING_POLICIES)
    add_flag(parser, "--prefix-caching", True, "reuse cached KV blocks of shared prompt prefixes")
    add_flag(parser, "--enforce-eager", False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs "
             "captured at start (slower; starts sooner)")
    add_flag(parser, "--async-scheduling", True, "on a GPU, schedule each step while the one before runs, its "
             "sampled ids read back one step late (steps with grammars, speculation or preemption still wait); "
             "--no-async-scheduling reads every step's tokens back before the next is scheduled. Same tokens "
             "either way. A CPU runs steps where they are launched, so it reads each step back at once")
    add_flag(parser, "--tensor-parallel-size", 1, "split the model across this many ranks, one process each: "
             "cuda:0..N-1 (NCCL) on a GPU host, N CPU ranks (gloo) on CPU; heads, KV heads, intermediate size "
             "and vocabulary must divide by it")
    add_flag(parser, "--quantization", "none", "8-bit weights: none, fp8 (128x128 blocks) or int8 (a scale per "
             "output row): a bf16 checkpoint's linear layers are quantized as they load; an fp8 checkpoint "
             "(Qwen/Qwen3-*-FP8) is served as fp8 whatever this says", choices=["none", "fp8", "int8"])
    add_flag(parser, "--quantize-lm-head", False, "with 8-bit weights, the vocab projection in 8 bits too (else bf16)")
    add_flag(parser, "--int8-activations", True, "with --quantization int8 on CPU in bf16: each matmul's input rows "
             "are quantized to int8 too (a scale per row) and multiplied in integers on AMX-INT8 (or VNNI), "
             "faster; --no-int8-activations keeps bf16 activations (closer to bf16 weights' outputs)")
    add_flag(parser, "--vnni-weights", True, "bf16 on a CPU with AMX: reorder each decoder weight once, in place, "
             "into the order AMX reads it, and run every matmul in the C kernels on it (faster prefills; no "
             "memory added); --no-vnni-weights keeps the checkpoint's layout")
    add_flag(parser, "--engine-cpus", "", "CPUs the engine core alone runs on, such as 1 or 2-15 (empty: all of "
             "the worker's); its threads are sized to them, and the worker's gRPC front moves to its other CPUs. "
             "Run the gateway and tokenizer off them too (taskset, compose cpuset): on a CPU host their CPU time "
             "per token otherwise comes out of the engine's step",
             type=engine_cpus)
    add_flag(parser, "--stats-interval", 10.0, "seconds between log lines on load, KV cache and throughput "
             "while busy (0: none)")
    add_flag(parser, "--step-timeout", 120.0, "seconds the engine core may go without finishing a step while "
             "requests are open; past it the core is taken as hung: its stacks are logged, and it is restarted, its "
             "streams carried on there (--max-resumes) (0: never)")
    add_flag(parser, "--max-resumes", 3, "times one request's stream is carried on after the engine core dies "
             "under it: the new core goes on after the tokens already sent, so the caller sees one stream (0: "
             "the core's death ends every open stream with UNAVAILABLE, the way a worker's does)")
    add_flag(parser, "--resume-wait", 60.0, "longest a stream whose engine core died waits for the new core; past "
             "it the stream ends UNAVAILABLE")
    add_flag(parser, "--grammar-compile-timeout", 10.0, "seconds a structured-output grammar may take to compile "
             "(beside the engine's steps) before its request fails with RESOURCE_EXHAUSTED")
    add_flag(parser, "--speculative-method", "", "speculative decoding: ngram (prompt lookup: propose what followed "
             "the latest earlier occurrence of the last tokens) or draft (a smaller checkpoint with the same "
             "vocabulary, --speculative-model); empty: off", choices=("", "ngram", "draft"))
    add_flag(parser, "--speculative-model", "", "--speculative-method draft: the draft checkpoint directory (same "
             "vocabulary; it runs on the worker's device with a KV cache of its own)")
    add_flag(parser, "--num-speculative-tokens", 4, "most tokens proposed per sequence and step")
    add_flag(parser, "--ngram-max", 4, "prompt lookup: longest suffix matched")
    add_flag(parser, "--ngram-min", 2, "prompt lookup: shortest suffix matched")
    add_flag(parser, "--speculative-fixed-k", False, "always propose --num-speculative-tokens (default: each "
             "sequence's count adapts to how many of its recent proposals were accepted)")
    add_flag(parser, "--speculative-disable-batch-size", 8, "above this many running sequences, unseeded ones "
             "decode without proposals (the step is compute-bound there)")
    add_flag(parser, "--enable-lora", False, "serve LoRA adapters (docs/lora.md): requests name one as `adapter`; "
             "slots for --max-loras adapters of rank up to --max-lora-rank are allocated at start")
    parser.add_argument("--lora-modules", action="append", default=[], type=lora_module, metavar="NAME=PATH",
                        help="a PEFT adapter folder to load at start under NAME (repeatable; needs --enable-lora)")
    add_flag(parser, "--max-loras", 4, "LoRA adapters resident at once; loading one more evicts an idle one")
    add_flag(parser, "--max-lora-rank", 16, "the highest adapter rank (r) served; each slot is sized for it")
    parser.add_argument("--runner", default="auto", choices=RUNNERS,
                        help="what this worker serves: auto, Generate and pooling (Embed, Score) alike; generate, "
                             "Generate only; pooling, Embed and Score only, a worker kept for embeddings beside "
                             "generating ones (the gateway routes each kind only to workers that serve it)")
    add_auth_flags(parser)  # for deployments without mTLS; the gateway sends its --downstream-api-key
    args = parser.parse_args(argv)
    check_ranges(parser, args, (*SERVER_FLAG_RANGES, ("--stats-interval", 0, None), ("--step-timeout", 0, None),
                                ("--max-resumes", 0, None), ("--resume-wait", 0, None)))
    if args.max_model_len < 0:
        parser.error(f"--max-model-len must be >= 0 (0: the model's own limit), got {args.max_model_len}")
    if args.max_num_batched_tokens == 0:  # by device, never below the sequences a step may hold
        args.max_num_batched_tokens = max(default_step_tokens(args.device), args.max_num_seqs)
    try:
        engine_config(args)  # EngineConfig and the scheduler limits check their own ranges
    except ValueError as e:
        parser.error("--" + str(e).replace("_", "-"))
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        device=args.device, dtype=args.dtype, block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len or None,
        enable_prefix_caching=args.prefix_caching, enforce_eager=args.enforce_eager,
        async_scheduling=None if args.async_scheduling else False,  # on: where the device runs steps asynchronously
        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head, int8_activations=args.int8_activations,
        vnni_weights=None if args.vnni_weights else False,  # on: where the CPU and compiler allow
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        lora_modules=tuple(args.lora_modules), runner=args.runner,
        limits=SchedulerLimits(args.max_num_seqs, args.max_num_batched_tokens, args.max_waiting,
                               args.scheduling_policy),
        speculative=SpeculativeConfig(
            method=args.speculative_method or None, num_speculative_tokens=args.num_speculative_tokens,
            ngram_max=args.ngram_max, ngram_min=args.ngram_min, fixed_k=args.speculative_fixed_k,
            disable_batch_size=args.speculative_disable_batch_size, draft_model=args.speculative_model or None))


async def serve(args: argparse.Namespace) -> None:
    service = worker_pb2.DESCRIPTOR.services_by_name["ModelWorkerService"]
    server = GrpcServer(ServerConfig.from_args(args), [service.full_name], interceptors=auth_interceptors(args))
    servicer = ModelWorkerServicer(served_model_name(args.model), max_message_bytes=args.max_message_bytes)
    add_servicer(server.server, service, servicer)
    await server.start()  # health answers NOT_SERVING while the weights load
    try:
        await serve_started(args, server, servicer)
    finally:
        await server.close()


async def serve_started(args: argparse.Namespace, server: GrpcServer, servicer: ModelWorkerServicer) -> None:
    """Once listening: start the engine core on the checkpoint and serve until a signal or its failure."""
    checkpoint = resolve_model(args.model)
    # The model loads and steps in a separate engine-core process; this one only serves gRPC.
    client = EngineClient(checkpoint, engine_config(args), log_level=args.log_level,
                          stats_interval_s=args.stats_interval, on_serving=server.set_serving, on_step=observe_step,
                          engine_cpus=args.engine_cpus, step_timeout_s=args.step_timeout,
                          max_resumes=args.max_resumes, resume_wait_s=args.resume_wait)
    REGISTRY.register(EngineCollector(client))
    servicer.engine = client
    try:
        info = await client.start()
        log.info("serving %s on %s as %s (max context %d tokens; engine core: CPUs %s, threads %d)", checkpoint,
                 info["device"], info["dtype"], info["max_model_len"], info["cpus"], info["threads"])
        if info["is_demo_checkpoint"]:
            log.warning("%s is the demo checkpoint: its weights are RANDOM, so generated text is gibberish",
                        checkpoint)
        serving = asyncio.ensure_future(server.run_until_signal(on_stop=client.close,
                                                                   on_drain=client.drain))
        failed = asyncio.ensure_future(client.failed.wait())
        await asyncio.wait([serving, failed], return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():  # the engine is gone for good: its streams already got UNAVAILABLE
            serving.cancel()
            await server.set_serving(False)
            await server.server.stop(1.0)
            raise WorkerFailed(client.failure)
        failed.cancel()
    finally:
        await client.close()  # whatever ended serving, never leave the engine core behind


def main(argv=None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level)
    if args.engine_cpus is not None:
        # Before the gRPC server starts its threads, so they start on the CPUs left over.
        front = cpu_affinity.keep_process_off(args.engine_cpus)
        log.info("--engine-cpus %s: this process runs on CPUs %s", cpu_affinity.format_cpu_list(args.engine_cpus),
                 cpu_affinity.format_cpu_list(front) if front else
                 f"{cpu_affinity.current()} too (no other CPU is available to it)")
    try:
        asyncio.run(serve(args))
    except (ConfigError, CoreStartError) as e:
        raise SystemExit(f"cannot serve {args.model}: {e}") from None
    except WorkerFailed as e:
        raise SystemExit(f"stopped serving {args.model}: {e}") from None


if __name__ == "__main__":
    main()
