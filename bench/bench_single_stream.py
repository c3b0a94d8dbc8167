"""Single-stream decode speed as a user gets it: through the gateway, from the worker, in-process, and transformers.

Starts the tokenizer, model worker and gateway as subprocesses on the random checkpoint with
Qwen3-0.6B's exact config (bf16), then runs one greedy request at a time (a 128-token prompt,
64 new tokens by default), interleaved in rounds (the order reversed every other round):
  - gateway: a gRPC client streaming text from the gateway;
  - worker: a gRPC client streaming token ids straight from the model worker;
  - in-process: this script's own LLMEngine on its main thread, stepping in a loop;
  - transformers: `generate` on the same checkpoint and token ids.
Decode tokens/s counts the tokens after the first, over the time from the first to the last;
prefill is the time to the first token. Medians with min-max; each ratio is the median of the
per-round ratios (the paths paired within a round). The last line is one JSON object.

    python -m bench.bench_single_stream            # about 5 minutes on 2 cores
    python -m bench.bench_single_stream --quick    # a smoke check
    python -m bench.bench_single_stream --device cuda   # the worker, in-process engine and transformers on a GPU
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.bench_engine import Run, cpu_name, ensure_checkpoint, run_ours, run_transformers  # noqa: E402
from bench.bench_serving import make_text, word_pool  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.tokenizer.core import TokenizerCore  # noqa: E402
from tests.integration.stack import make_stack  # noqa: E402
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / ".cache" / "serving-qwen3-0.6b"
TARGETS = {"gateway_vs_transformers": 2.0, "gateway_vs_in_process": 0.95}


async def _timed(stream, count) -> Run:
    start, stamps, tokens = time.perf_counter(), [], []
    async for message in stream:
        got = count(message)
        if got:
            tokens.extend(got)
            stamps.append(time.perf_counter())
    return Run(stamps[0] - start, stamps[-1] - stamps[0], tokens)


async def run_gateway(address: str, text: str, new_tokens: int) -> Run:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GenerateRequest(prompt=text, max_tokens=new_tokens, temperature=0, ignore_eos=True)
        return await _timed(stub.Generate(request), lambda m: list(m.token_ids))


async def run_worker(address: str, prompt_ids: list[int], new_tokens: int) -> Run:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.ModelWorkerServiceStub(channel)
        request = worker_pb2.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=new_tokens, ignore_eos=True,
                                             sampling=worker_pb2.SamplingParams(temperature=0.0))
        return await _timed(stub.Generate(request), lambda m: [m.token_id])


def summary(runs: list[Run]) -> dict:
    tps = [r.decode_tps for r in runs]
    ttft = [r.ttft for r in runs]
    return {"decode_tok_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps)},
            "prefill_s": {"median": statistics.median(ttft), "min": min(ttft), "max": max(ttft)}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the in-process engine and transformers")
    p.add_argument("--worker-flag", action="append", default=[], help="extra worker flag, e.g. --worker-flag=--x=1")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N, for the worker, in-process engine and "
                   "transformers alike")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="on a GPU, the share each of the two engines (worker, in-process) takes")
    p.add_argument("--quick", action="store_true", help="a tiny checkpoint and one short round")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.prompt_tokens, args.new_tokens = 1, 16, 8
    torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="bench-single-")
    checkpoint = ensure_checkpoint(pathlib.Path(tmp) / "tiny" if args.quick else args.checkpoint,
                                   "tiny" if args.quick else "qwen3-0.6b")
    tokenizer = TokenizerCore.from_dir(checkpoint)
    text = make_text(random.Random(0), word_pool(tokenizer), tokenizer, args.prompt_tokens)
    prompt_ids = tokenizer.encode(text)
    print(f"prompt {len(prompt_ids)} tokens, {args.new_tokens} new tokens, greedy; {args.repeats} rounds; "
          f"load average {' '.join(f'{x:.2f}' for x in load_before)} on {os.cpu_count()} CPUs", flush=True)

    from transformers import Qwen3ForCausalLM
    reference = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(args.device).eval()
    device_flags = ["--device", args.device]
    config = EngineConfig(device=args.device, dtype="bfloat16")
    if args.device != "cpu":
        # Two engines and transformers share the GPU: each engine takes a fraction, and a short context.
        max_len = 4 * (len(prompt_ids) + args.new_tokens)
        config = EngineConfig(device=args.device, dtype="bfloat16", max_model_len=max_len,
                              gpu_memory_utilization=args.gpu_memory_utilization)
        device_flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization), "--max-model-len", str(max_len)]
    engine = LLMEngine(checkpoint, config)
    stack = make_stack(str(checkpoint), tmp, worker_flags=["--dtype", "bfloat16", *device_flags, *args.worker_flag])
    stack.start(timeout=600)
    runs: dict[str, list[Run]] = {"gateway": [], "worker": [], "in-process": [], "transformers": []}
    try:
        # One untimed round: first calls pay one-time costs (allocations, connections).
        asyncio.run(run_gateway(stack.gateway.address, text, 4))
        run_ours(engine, prompt_ids, 4)
        run_transformers(reference, prompt_ids, 4)
        measure = {
            "gateway": lambda: asyncio.run(run_gateway(stack.gateway.address, text, args.new_tokens)),
            "worker": lambda: asyncio.run(run_worker(stack.worker.address, prompt_ids, args.new_tokens)),
            "in-process": lambda: run_ours(engine, prompt_ids, args.new_tokens),
            "transformers": lambda: run_transformers(reference, prompt_ids, args.new_tokens),
        }
        for round_ in range(args.repeats):
            for name in (list(measure) if round_ % 2 == 0 else list(measure)[::-1]):  # no path always first
                runs[name].append(measure[name]())
            print(f"round {round_ + 1}: " + "  ".join(f"{name} {r[-1].decode_tps:.1f} tok/s"
                                                    for name, r in runs.items()), flush=True)
    finally:
        stack.stop()
    results = {name: summary(r) for name, r in runs.items()}
    print(f"\n{'':14s}{'decode tok/s':>28s}{'prefill s':>28s}")
    for name, res in results.items():
        d, f = res["decode_tok_s"], res["prefill_s"]
        print(f"{name:14s}{d['median']:10.2f} ({d['min']:.2f}-{d['max']:.2f}){'':4s}"
              f"{f['median']:10.3f} ({f['min']:.3f}-{f['max']:.3f})")
    # Every round runs each path once, so the ratios pair the paths within a round: the median of
    # the per-round ratios, not a ratio of medians taken from different rounds of a drifting machine.
    def paired(a: str, b: str) -> list[float]:
        return [x.decode_tps / y.decode_tps for x, y in zip(runs[a], runs[b])]

    per_round = {
        "gateway_vs_transformers": paired("gateway", "transformers"),
        "gateway_vs_in_process": paired("gateway", "in-process"),
        "worker_vs_in_process": paired("worker", "in-process"),
        "in_process_vs_transformers": paired("in-process", "transformers"),
    }
    ratios = {name: statistics.median(values) for name, values in per_round.items()}
    for name, value in ratios.items():
        target = TARGETS.get(name)
        verdict = f"  target >= {target}: {'met' if value >= target else 'MISSED'}" if target else ""
        print(f"  {name:28s} {value:6.2f}{verdict}  (per round: {', '.join(f'{v:.2f}' for v in per_round[name])})")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(json.dumps({"benchmark": "bench_single_stream", "machine": {
        "cpu": cpu_name(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "gpu": torch.cuda.get_device_name(args.device) if args.device != "cpu" else None},
        "settings": {"device": args.device, "prompt_tokens": len(prompt_ids), "new_tokens": args.new_tokens,
                     "repeats": args.repeats, "worker_flags": args.worker_flag},
        "results": results, "ratios": ratios, "per_round": per_round, "targets": TARGETS, "wall_s": time.perf_counter() - started}))


if __name__ == "__main__":
    main()
