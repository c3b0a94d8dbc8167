"""Speculative decoding (prompt lookup) against plain decode, side by side, through the model worker service.

Starts two model workers on the random checkpoint with Qwen3-0.6B's exact config (bf16): one plain, one
with --speculative-method ngram. Then, interleaved in rounds (the order reversed every other round):

1. Input-grounded single stream. The prompt is a seed text followed by the plain worker's own greedy
   continuation of it (--grounding tokens). A random-weights model's greedy output settles into a
   repeating loop within a few dozen tokens, so its continuation of that prompt repeats spans that
   are already in the prompt: the same thing an edit of a given text or an answer quoted from a
   given document does with a trained model. Both workers must stream the same tokens (greedy is
   exact); reported: decode tok/s of each (tokens after the first over the time from the first to the
   last), the ratio (target >= 1.8), the acceptance rate and the tokens per target pass (from the
   stream: a verification step's last token carries spec_accepted).
2. 16 streams of plain text at once (random words, no repeats to find): output tok/s of each worker,
   and the ratio (target: within 3% of plain). Past --speculative-disable-batch-size running sequences
   the speculative worker decodes plainly, so this measures what its bookkeeping costs.

Then, with the workers stopped, in this process (no second copy of the weights in memory at once):
3. Verification mechanics: the target's forward over one sequence's last token plus k proposals
   (k = 1..8) against one plain decode step, at the same context: the cost of a verification step
   in decode steps.
4. Draft model: a draft made of the same checkpoint's embeddings, first --draft-layers layers and
   final norm (the same weights family), proposing a fixed k = 1, 2, 4, 8 for the same prompt, beside
   plain decode on the same engine: mean accepted length per verification, and decode tok/s.

    python -m bench.bench_speculative --checkpoint PATH      # ~10 minutes on 2 busy cores
    python -m bench.bench_speculative --quick                # a smoke check on a tiny checkpoint
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

from bench.bench_engine import cpu_name, ensure_checkpoint  # noqa: E402
from bench.bench_serving import make_text, word_pool  # noqa: E402
from services.tokenizer.core import TokenizerCore  # noqa: E402
from tests.integration.stack import Service, free_port, wait_serving  # noqa: E402
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / ".cache" / "bench-qwen3-0.6b"
TARGETS = {"single_stream_speedup": 1.8, "streams16_ratio_min": 0.97}
SEED_TEXT = "Please copy the following report exactly, then continue it:"


async def stream(address: str, prompt_ids: list[int], new_tokens: int) -> dict:
    """One greedy request: its tokens, the time to the first and of the last, and its verification markers."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.ModelWorkerServiceStub(channel)
        request = worker_pb2.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=new_tokens, ignore_eos=True,
                                             sampling=worker_pb2.SamplingParams(temperature=0.0))
        start, stamps, tokens, accepted = time.perf_counter(), [], [], []
        async for message in stub.Generate(request):
            tokens.append(message.token_id)
            stamps.append(time.perf_counter())
            if message.HasField("spec_accepted"):
                accepted.append(message.spec_accepted)
    verified_tokens = sum(a + 1 for a in accepted)
    passes = len(accepted) + (len(tokens) - 1 - verified_tokens)  # after the prefill's token
    return {"tokens": tokens, "ttft": stamps[0] - start, "decode_s": stamps[-1] - stamps[0],
            "decode_tps": (len(tokens) - 1) / (stamps[-1] - stamps[0]), "verifications": len(accepted),
            "accepted": sum(accepted), "tokens_per_pass": (len(tokens) - 1) / max(passes, 1)}


async def many(address: str, prompts: list[list[int]], new_tokens: int) -> float:
    """All prompts at once; output tokens/s over the whole run."""
    start = time.perf_counter()
    results = await asyncio.gather(*(stream(address, p, new_tokens) for p in prompts))
    return sum(len(r["tokens"]) for r in results) / (time.perf_counter() - start)


def info(address: str) -> worker_pb2.GetInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.ModelWorkerServiceStub(channel).GetInfo(worker_pb2.GetInfoRequest())


def verification_cost(checkpoint: pathlib.Path, context: int, repeats: int) -> dict[int, float]:
    """Median forward time of one sequence's verification step with k proposals, over a plain decode step's."""
    from services.model_worker.config.engine import EngineConfig
    from services.model_worker.engine.llm_engine import LLMEngine
    from services.model_worker.executor.step_inputs import StepInputs

    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", kv_cache_bytes=64 << 20))
    size = engine.kv_cache.block_size
    table = list(range(-(-(context + 9) // size)))
    ids = torch.randint(0, engine.config.vocab_size, (context + 9,)).tolist()
    # Fill the cache for the context once (a prefill), so every timed step reads real keys.
    engine.runner.run(StepInputs.build([ids[:context]], [table], [context], size))

    def step(k: int) -> float:
        # As the scheduler lays a verification out: k + 1 one-token rows, row j seeing the context up to itself.
        new = ids[context:context + k + 1]
        host = StepInputs.build([[t] for t in new], [table] * (k + 1), list(range(context + 1, context + k + 2)),
                                size, [k], (), [k])
        start = time.perf_counter()
        engine.runner.run(host)
        return time.perf_counter() - start

    times: dict[int, list[float]] = {k: [] for k in range(9)}
    for _ in range(repeats):
        for k in range(9):
            times[k].append(step(k))
    base = statistics.median(times[0])
    return {k: statistics.median(t) / base for k, t in times.items() if k}


def truncated_draft(checkpoint: pathlib.Path, layers: int, out: pathlib.Path) -> pathlib.Path:
    """A draft from the same weights: the embeddings, the first `layers` decoder layers and the final norm."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((checkpoint / "config.json").read_text())
    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
                    continue
                tensors[name] = f.get_tensor(name)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers, "max_window_layers": layers}))
    return out


def draft_mechanics(checkpoint: pathlib.Path, draft: pathlib.Path, prompt_ids: list[int], new_tokens: int,
                    ks: list[int]) -> dict:
    """In this process: greedy generation with the draft proposing a fixed k, for each k, then adapting k as the
    engine does by default, beside plain decode on the same engine; accepted length per verification and tok/s."""
    from services.model_worker.config.engine import EngineConfig, SpeculativeConfig
    from services.model_worker.config.sampling import SamplingParams
    from services.model_worker.engine.llm_engine import LLMEngine

    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", kv_cache_bytes=128 << 20,
                                                max_model_len=2048, speculative=SpeculativeConfig(
                                                    "draft", draft_model=str(draft), fixed_k=True)))
    speculator = engine.speculator
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    def timed(spec) -> tuple[float, list[int]]:
        engine.speculator = spec
        engine.add_request("m", prompt_ids, params)
        stamps, tokens = [], []
        while engine.has_work():
            for out in engine.step():
                stamps.append(time.perf_counter())
                tokens.append(out.token_id)
        return (len(tokens) - 1) / (stamps[-1] - stamps[0]), tokens

    timed(None)  # one-time costs
    plain_tps, _ = timed(None)
    results = {"plain_decode_tps": plain_tps, "by_k": {}}
    for k in [*ks, "adaptive"]:
        # "adaptive": k up to 4, following acceptance, single refused proposals resting the sequence (the default).
        speculator.config.fixed_k = k != "adaptive"
        speculator.config.num_speculative_tokens = 4 if k == "adaptive" else k
        before = (speculator.num_proposed, speculator.num_accepted, speculator.num_verify_steps)
        tps, _ = timed(speculator)
        proposed, accepted, steps = (now - then for now, then in zip(
            (speculator.num_proposed, speculator.num_accepted, speculator.num_verify_steps), before))
        results["by_k"][k] = {"mean_accepted_length": accepted / max(steps, 1),
                              "acceptance_rate": accepted / max(proposed, 1), "decode_tps": tps,
                              "speedup": tps / plain_tps}
        print(f"  draft k={k}: mean accepted length {accepted / max(steps, 1):.2f}, acceptance "
              f"{accepted / max(proposed, 1):.2f}, {tps:.2f} tok/s (plain {plain_tps:.2f})", flush=True)
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--grounding", type=int, default=96, help="tokens of the model's own continuation in the prompt")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=24, help="new tokens per request of the 16-stream runs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--draft-layers", type=int, default=4, help="layers of the truncated draft model")
    p.add_argument("--draft-tokens", type=int, default=32, help="new tokens per draft-model run")
    p.add_argument("--quick", action="store_true", help="a tiny checkpoint and one short round")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.grounding, args.new_tokens, args.streams, args.stream_tokens = 1, 32, 16, 4, 8
        args.draft_tokens = 8
    started, load_before = time.perf_counter(), os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="bench-spec-")
    checkpoint = ensure_checkpoint(pathlib.Path(tmp) / "tiny" if args.quick else args.checkpoint,
                                   "tiny" if args.quick else "qwen3-0.6b")
    tokenizer = TokenizerCore.from_dir(checkpoint)
    common = ["services.model_worker", "--model", str(checkpoint), "--dtype", "bfloat16", "--kv-cache-bytes",
              "256MiB", "--max-model-len", "2048", "--stats-interval", "0"]
    workers = {
        "plain": Service("plain", common, free_port(), f"{tmp}/plain.log"),
        "ngram": Service("ngram", [*common, "--speculative-method", "ngram", "--num-speculative-tokens",
                                   str(args.k)], free_port(), f"{tmp}/ngram.log"),
    }
    print(f"load average {' '.join(f'{x:.2f}' for x in load_before)} on {os.cpu_count()} CPUs "
          "(a shared machine: other work runs beside this)", flush=True)
    single: dict[str, list[dict]] = {"plain": [], "ngram": []}
    streams16: dict[str, list[float]] = {"plain": [], "ngram": []}
    agreement: list[int] = []  # per round: the tokens both workers streamed alike before the first difference
    try:
        for worker in workers.values():
            worker.start()
        for worker in workers.values():
            wait_serving(worker.address, timeout=600)
        seed = tokenizer.encode(SEED_TEXT)
        grounding = asyncio.run(stream(workers["plain"].address, seed, args.grounding))["tokens"]
        prompt = seed + grounding
        rng = random.Random(0)
        pool = word_pool(tokenizer)
        texts = [tokenizer.encode(make_text(rng, pool, tokenizer, 64)) for _ in range(args.streams)]
        for worker in workers.values():  # one untimed request each: first calls pay one-time costs
            asyncio.run(stream(worker.address, prompt, 4))
        for round_ in range(args.rounds):
            order = list(workers) if round_ % 2 == 0 else list(workers)[::-1]
            for name in order:
                single[name].append(asyncio.run(stream(workers[name].address, prompt, args.new_tokens)))
            for name in order:
                streams16[name].append(asyncio.run(many(workers[name].address, texts, args.stream_tokens)))
            # In bf16 a verification row (a query of several tokens: the prefill-style kernels) and a decode step
            # (the fused decode kernel) round differently, so a near tie can go the other way: report agreement.
            same = next((i for i, (x, y) in enumerate(zip(single["plain"][-1]["tokens"],
                                                          single["ngram"][-1]["tokens"])) if x != y), args.new_tokens)
            agreement.append(same)
            s = single["ngram"][-1]
            print(f"round {round_ + 1}: single stream plain {single['plain'][-1]['decode_tps']:.2f} tok/s, ngram "
                  f"{s['decode_tps']:.2f} tok/s ({s['tokens_per_pass']:.2f} tokens per pass); {args.streams} streams "
                  f"plain {streams16['plain'][-1]:.1f} tok/s, ngram {streams16['ngram'][-1]:.1f} tok/s", flush=True)
        spec_info = info(workers["ngram"].address)
    finally:
        for worker in workers.values():
            worker.stop()
    speedups = [s["decode_tps"] / p["decode_tps"] for s, p in zip(single["ngram"], single["plain"])]
    ratios16 = [s / p for s, p in zip(streams16["ngram"], streams16["plain"])]
    mechanics = verification_cost(checkpoint, len(prompt), 3 if args.quick else 7)
    print("verification step (1 + k tokens) / one decode step, same context: "
          + ", ".join(f"k={k}: {v:.2f}" for k, v in mechanics.items()), flush=True)
    layers = 1 if args.quick else args.draft_layers
    print(f"draft model: the first {layers} layers of the same checkpoint", flush=True)
    draft = draft_mechanics(checkpoint, truncated_draft(checkpoint, layers, pathlib.Path(tmp) / "draft"), prompt,
                            args.draft_tokens, [1, 2, 4, 8])
    results = {
        "single_stream": {
            "plain_decode_tps": statistics.median(r["decode_tps"] for r in single["plain"]),
            "ngram_decode_tps": statistics.median(r["decode_tps"] for r in single["ngram"]),
            "speedup": statistics.median(speedups), "speedup_per_round": speedups,
            "tokens_per_target_pass": statistics.median(r["tokens_per_pass"] for r in single["ngram"]),
            "identical_prefix_tokens_per_round": agreement,
            "acceptance_rate_since_start": spec_info.speculative_acceptance_rate,
            "proposed_since_start": spec_info.speculative_proposed_tokens,
            "accepted_since_start": spec_info.speculative_accepted_tokens},
        "streams": {"count": args.streams, "plain_tps": statistics.median(streams16["plain"]),
                    "ngram_tps": statistics.median(streams16["ngram"]), "ratio": statistics.median(ratios16),
                    "ratio_per_round": ratios16},
        "verification_step_cost_vs_decode_step": mechanics,
        "draft": {"layers": layers, **draft},
    }
    r = results["single_stream"]
    print(f"\ninput-grounded single stream ({len(prompt)}-token prompt, {args.new_tokens} new tokens, k={args.k}):")
    print(f"  plain {r['plain_decode_tps']:.2f} tok/s, ngram {r['ngram_decode_tps']:.2f} tok/s: x{r['speedup']:.2f} "
          f"(target >= {TARGETS['single_stream_speedup']}: "
          f"{'met' if r['speedup'] >= TARGETS['single_stream_speedup'] else 'MISSED'})")
    print(f"  acceptance {r['acceptance_rate_since_start']:.2f} ({r['accepted_since_start']} of "
          f"{r['proposed_since_start']} proposed, every request since start), "
          f"{r['tokens_per_target_pass']:.2f} tokens per target pass")
    print(f"  tokens streamed alike by both before the first difference (bf16 rounding), per round: {agreement}")
    s = results["streams"]
    print(f"{args.streams} streams of plain text: plain {s['plain_tps']:.1f} tok/s, ngram {s['ngram_tps']:.1f} tok/s: "
          f"x{s['ratio']:.3f} (target >= {TARGETS['streams16_ratio_min']}: "
          f"{'met' if s['ratio'] >= TARGETS['streams16_ratio_min'] else 'MISSED'})")
    print(json.dumps({"benchmark": "bench_speculative", "machine": {
        "cpu": cpu_name(), "cpus": os.cpu_count(), "load_average_before": load_before,
        "load_average_after": os.getloadavg()},
        "settings": {"prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "rounds": args.rounds, "k": args.k,
                     "streams": args.streams, "stream_tokens": args.stream_tokens},
        "results": results, "targets": TARGETS, "wall_s": time.perf_counter() - started}))


if __name__ == "__main__":
    main()
