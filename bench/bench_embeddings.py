"""Embedding throughput: a batch of prompts embedded by our engine in process, by a model worker through gRPC Embed,
and by transformers' batched forward, side by side.

The checkpoint is the random one with Qwen3-0.6B's exact config (the shape of Qwen3-Embedding-0.6B); an embedding
is the last token's final hidden state, L2-normalised, in every path. Each round embeds fresh random prompts (so no
prefix cache helps) with every path in turn, the order reversed every other round; medians with min-max, and each
ratio is the median of the per-round ratios. The worker runs as its own process (gRPC server plus engine core); the
in-process engine and transformers run on this process's main thread.

It also prints the bound: a round's arithmetic (every linear layer's weights once per token, plus causal
attention) at the fastest matmul rate measured here, in the engine's weight format or as torch's F.linear, on the
largest matmul of a step. No forward runs faster than that, so transformers' time over it is the most any engine
can beat transformers by on this machine. The last line is one JSON object.

    python -m bench.bench_embeddings                      # 64 prompts of 128 tokens, bf16 and float32, 3 rounds
    python -m bench.bench_embeddings --dtypes bfloat16 --rounds 5
    python -m bench.bench_embeddings --quick              # the tiny preset, one round: a smoke check
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# The OpenMP spin count the worker gives its engine core (core/process.py), set before torch loads libgomp, so
# the in-process engine and transformers wait between parallel regions as the worker's core does: with libgomp's
# default, any other load on the CPUs made this process's steps several times slower than the worker's.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"

import grpc  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_engine import cpu_name, ensure_checkpoint  # noqa: E402
from services.model_worker.config.engine import CPU_STEP_TOKENS, EngineConfig, SchedulerLimits  # noqa: E402
from services.model_worker.engine.llm_engine import LLMEngine  # noqa: E402
from services.model_worker.engine.pooling import PoolingParams  # noqa: E402
from tests.integration.stack import Service, free_port, wait_serving  # noqa: E402
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / ".cache" / "bench-qwen3-0.6b"
TARGET = 3.0  # ours (in process and through the worker) against transformers, on CPU
PATHS = ("engine", "worker", "transformers")


class Transformers:
    """transformers' Qwen3Model on the same checkpoint: batched forwards, last position, normalised."""

    def __init__(self, checkpoint: pathlib.Path, dtype: torch.dtype, batch: int):
        from transformers import Qwen3Model
        self.model = Qwen3Model.from_pretrained(checkpoint, dtype=dtype).eval()
        self.batch = batch

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]]) -> torch.Tensor:
        out = []
        for start in range(0, len(prompts), self.batch):
            ids = torch.tensor(prompts[start:start + self.batch])  # equal lengths: no padding, no mask needed
            out.append(self.model(input_ids=ids).last_hidden_state[:, -1].float())
        return F.normalize(torch.cat(out), dim=-1)


class Worker:
    """A model worker process on its own port, and a blocking stub to it."""

    def __init__(self, checkpoint: pathlib.Path, dtype: str, step_tokens: int, log_dir: str):
        self.service = Service("worker", ["services.model_worker", "--model", str(checkpoint), "--device", "cpu",
                                          "--dtype", dtype, "--max-num-batched-tokens", str(step_tokens)],
                               free_port(), f"{log_dir}/worker-{dtype}.log")
        self.service.start()
        try:
            wait_serving(self.service.address, timeout=600)
        except TimeoutError:
            self.close()
            raise
        self.channel = grpc.insecure_channel(self.service.address, options=[
            ("grpc.max_receive_message_length", 64 << 20)])
        self.stub = worker_pb2_grpc.ModelWorkerServiceStub(self.channel)

    def embed(self, prompts: list[list[int]]) -> torch.Tensor:
        inputs = [worker_pb2.TokenIds(token_ids=p) for p in prompts]
        response = self.stub.Embed(worker_pb2.EmbedRequest(request_id="bench", inputs=inputs), timeout=600)
        return torch.tensor([list(e.values) for e in response.embeddings])

    def close(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        self.service.stop()


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=generator).tolist()


def model_flops(config: dict, requests: int, tokens: int) -> float:
    """Multiply-adds x 2 of one round: every linear layer's weights once per token, and causal attention's
    scores and weighted sums (each position against itself and the ones before it)."""
    hidden, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    linear = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    attention_pairs = tokens * (tokens + 1) / 2  # per prompt, per head
    per_layer = 2 * linear * tokens + 2 * 2 * attention_pairs * q
    return requests * layers * per_layer


@torch.inference_mode()
def matmul_rate(engine: LLMEngine, rows: int, torch_dtype: torch.dtype) -> dict[str, float]:
    """FLOP/s of the largest matmul of a step (the first layer's gate/up, `rows` rows) in the engine's own weight
    format, and as torch's F.linear on plain weights: the arithmetic a forward of this model rests on."""
    layer = engine.model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(rows, layer.in_features, dtype=torch_dtype)
    plain = torch.randn(layer.out_features, layer.in_features, dtype=torch_dtype)
    rates = {}
    for name, run in (("engine", lambda: layer.method.apply(layer, x)),
                      ("torch", lambda: F.linear(x, plain))):
        for _ in range(3):
            run()
        best = float("inf")
        for _ in range(5):  # the fastest of several: other load on a shared machine only slows a run
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        rates[name] = 2 * rows * layer.in_features * layer.out_features / best
    return rates


def bench_dtype(checkpoint: pathlib.Path, dtype: str, args, vocab: int, log_dir: str) -> dict:
    torch_dtype = getattr(torch, dtype)
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype=dtype, limits=SchedulerLimits(
        max_num_batched_tokens=args.step_tokens)))
    worker = Worker(checkpoint, dtype, args.step_tokens, log_dir)
    reference = Transformers(checkpoint, torch_dtype, args.hf_batch)
    paths = {
        "engine": lambda prompts: torch.tensor(engine.pool(prompts, PoolingParams.embed())),
        "worker": worker.embed,
        "transformers": reference.embed,
    }
    seconds: dict[str, list[float]] = {name: [] for name in PATHS}
    agreement: dict[str, list[float]] = {"engine": [], "worker": []}
    try:
        warm = random_prompts(8, args.tokens, vocab, seed=12345)
        for embed in paths.values():
            embed(warm)
        for round_index in range(args.rounds):
            prompts = random_prompts(args.requests, args.tokens, vocab, seed=round_index)
            order = PATHS if round_index % 2 == 0 else PATHS[::-1]
            results = {}
            for name in order:
                start = time.perf_counter()
                results[name] = paths[name](prompts)
                seconds[name].append(time.perf_counter() - start)
            for name in agreement:  # the same vectors, or the timing means nothing
                cosine = F.cosine_similarity(results[name], results["transformers"], dim=-1)
                agreement[name].append(cosine.min().item())
            print(f"  {dtype} round {round_index + 1}: " + ", ".join(
                f"{name} {seconds[name][-1]:.2f} s" for name in PATHS), file=sys.stderr, flush=True)
        rates = matmul_rate(engine, args.step_tokens, torch_dtype)
    finally:
        worker.close()
        engine.close()
    tokens = args.requests * args.tokens
    summary = {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                      "tokens_per_s": tokens / statistics.median(t)} for name, t in seconds.items()}
    ratios = {f"{name}_vs_transformers": statistics.median(
        b / a for a, b in zip(seconds[name], seconds["transformers"])) for name in ("engine", "worker")}
    ratios["worker_vs_engine"] = statistics.median(a / b for a, b in zip(seconds["engine"], seconds["worker"]))
    # The bound: a round's arithmetic at the fastest matmul rate measured here. No engine runs a forward faster,
    # so transformers' time over it is the most any engine can beat transformers by on this machine.
    flops = model_flops(json.loads((checkpoint / "config.json").read_text()), args.requests, args.tokens)
    floor_s = flops / max(rates.values())
    bound = {"round_tflop": flops / 1e12, "matmul_gflops": {k: v / 1e9 for k, v in rates.items()},
             "floor_s": floor_s, "max_ratio": summary["transformers"]["median_s"] / floor_s,
             "fraction_of_bound": {name: floor_s / summary[name]["median_s"] for name in PATHS}}
    return {"paths": summary, "ratios": ratios, "bound": bound,
            "min_cosine": {k: min(v) for k, v in agreement.items()}}


def print_table(results: dict, args) -> None:
    print(f"\n{args.requests} embeddings of {args.tokens} tokens; {cpu_name()}, {args.threads} threads in process, "
          f"{args.rounds} rounds, step of {args.step_tokens} tokens, transformers in batches of {args.hf_batch}")
    print(f"{'dtype':<9} {'path':<13} {'median s':>9} {'min-max s':>13} {'tokens/s':>9}")
    for dtype, result in results.items():
        for name in PATHS:
            p = result["paths"][name]
            print(f"{dtype:<9} {name:<13} {p['median_s']:>9.3f} {p['min_s']:>6.3f}-{p['max_s']:<6.3f} "
                  f"{p['tokens_per_s']:>9.0f}")
        ratios = result["ratios"]
        print(f"{dtype:<9} ratios: engine/transformers {ratios['engine_vs_transformers']:.2f}x, "
              f"worker/transformers {ratios['worker_vs_transformers']:.2f}x (target {TARGET:.0f}x), "
              f"worker/engine {ratios['worker_vs_engine']:.2f}x; min cosine to transformers: "
              + ", ".join(f"{k} {v:.6f}" for k, v in result["min_cosine"].items()))
        b = result["bound"]
        print(f"{dtype:<9} bound: {b['round_tflop']:.2f} TFLOP a round; matmul {b['matmul_gflops']['engine']:.0f} GFLOP/s "
              f"in the engine's format, {b['matmul_gflops']['torch']:.0f} as F.linear; at the faster, a round takes "
              f"at least {b['floor_s']:.2f} s, so no engine beats transformers here by more than {b['max_ratio']:.2f}x; "
              "share of that bound reached: " + ", ".join(f"{k} {v:.0%}" for k, v in b["fraction_of_bound"].items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_embeddings", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT,
                   help="the random Qwen3-0.6B-shaped checkpoint (written there if missing)")
    p.add_argument("--quick", action="store_true", help="the tiny preset, one round: a smoke check")
    p.add_argument("--requests", type=int, default=64, help="prompts per round")
    p.add_argument("--tokens", type=int, default=128, help="tokens per prompt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--step-tokens", type=int, default=CPU_STEP_TOKENS,
                   help="tokens per engine step, in process and in the worker (the worker's CPU default)")
    p.add_argument("--hf-batch", type=int, default=32, help="prompts per transformers forward")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the in-process engine and transformers")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = ensure_checkpoint(pathlib.Path(tmp) / "tiny" if args.quick else args.checkpoint_dir,
                                       "tiny" if args.quick else "qwen3-0.6b")
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        results = {dtype: bench_dtype(checkpoint, dtype, args, vocab, tmp) for dtype in args.dtypes}
    print_table(results, args)
    print(f"load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
          f"after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(json.dumps({"cpu": cpu_name(), "requests": args.requests, "tokens": args.tokens, "rounds": args.rounds,
                      "step_tokens": args.step_tokens, "results": results}))


if __name__ == "__main__":
    main()
