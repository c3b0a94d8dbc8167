"""Structured-output overhead: engine tok/s at 16 streams, none constrained against one constrained.

In one process, on a random checkpoint with Qwen3-0.6B's config and the real vocabulary (bf16), rounds
alternate (plain, constrained, constrained, plain, ...) on the same prompts. Each round runs 16 greedy
streams of --new-tokens tokens together; in a constrained round one of them carries a regex that
cannot complete within the run (so its mask is filled and applied at every step). tok/s counts every
stream's tokens over the round's wall time. The issue's target: the constrained rounds within 5%.

    python -m bench.bench_structured                       # ~1 min of setup, then the rounds
    python -m bench.bench_structured --checkpoint-dir DIR   # reuse a cached 0.6B-shaped checkpoint
    python -m bench.bench_structured --rounds 0             # only the interleaved decode steps

Then, less sensitive to a shared machine's bursts, decode steps of one 16-stream batch alternate with the
first stream's constraint switched on and off, and the step-thread time of the grammar work is printed.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_engine import DEFAULT_CHECKPOINT, ensure_checkpoint, random_prompt  # noqa: E402
from services.model_worker.config.sampling import SamplingParams, StructuredOutput  # noqa: E402
from services.model_worker.engine import llm_engine  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.model_worker.executor import grammar  # noqa: E402

# Lowercase letters only, far more than a run generates: the grammar never completes during a round.
ENDLESS = StructuredOutput("regex", "[a-z]{4000}")


class GrammarClock:
    """Seconds the step thread spends on grammar work (waiting for a mask, applying it, advancing the
    matcher): the serial cost a constrained stream adds to every step, less noisy than tok/s on a
    shared machine. The mask fill itself runs on the grammar thread and is not counted here."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = {"mask": 0, "apply": 0, "accept": 0}
        for owner, name, key in ((grammar.GrammarState, "mask", "mask"), (grammar.GrammarState, "accept", "accept"),
                                 (llm_engine, "apply_token_bitmask", "apply")):
            setattr(owner, name, self._timed(getattr(owner, name), key))

    def _timed(self, fn, key):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls[key] += 1
        return timed


def run_round(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, constrained: bool) -> float:
    plain = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    params = [plain] * len(prompts)
    if constrained:
        params = [SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                                 structured_output=ENDLESS)] + params[1:]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert all(len(o) == new_tokens for o in outputs), "a stream ended early: the round is not comparable"
    return sum(len(o) for o in outputs) / seconds


def run_interleaved_steps(engine: LLMEngine, prompts: list[list[int]], steps: int) -> tuple[list[float], list[float]]:
    """One batch of the streams, decoding; its first stream's constraint is switched on and off every other
    step, so that both kinds of step see the same batch, context lengths and machine load. Returns each
    kind's step times. (While switched off the matcher is not advanced: it stays a valid grammar state of
    the same cost, which is all timing needs.)"""
    plain = SamplingParams(temperature=0.0, max_tokens=steps * 2 + 4, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=steps * 2 + 4, ignore_eos=True,
                                 structured_output=ENDLESS)
    ids = [f"interleaved-{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        engine.add_request(rid, prompt, constrained if i == 0 else plain)
    while any(s.num_uncached_tokens > 1 for s in engine._seqs.values()):
        engine.step()  # prefill first: only decode steps are compared
    seq = engine._seqs[ids[0]]
    state = seq.grammar
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(steps * 2):
        on = (i % 4) in (1, 2)  # off, on, on, off, ...: neither kind always goes first
        seq.grammar = state if on else None
        if on and state._pending is None:
            state.prepare()
        start = time.perf_counter()
        engine.step()
        times[on].append(time.perf_counter() - start)
    for rid in ids:
        engine.abort(rid)
    return times[False], times[True]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4, help="pairs of rounds (plain + constrained)")
    p.add_argument("--interleaved-steps", type=int, default=40, help="decode steps of each kind, alternating")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    checkpoint = ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
    engine = LLMEngine(checkpoint, EngineConfig(device=args.device, dtype="bfloat16"))
    generator = torch.Generator().manual_seed(0)
    prompts = [random_prompt(args.prompt_tokens, 151_000, generator) for _ in range(args.streams)]
    run_round(engine, prompts, 4, constrained=True)  # warm up, and load the grammar's tokenizer once
    clock = GrammarClock()
    plain, constrained, ratios = [], [], []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {c: run_round(engine, prompts, args.new_tokens, c) for c in order}
        plain.append(got[False])
        constrained.append(got[True])
        ratios.append(got[True] / got[False])
        print(f"round {r}: plain {got[False]:.1f} tok/s, one constrained {got[True]:.1f} tok/s, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    if not ratios:
        plain = constrained = ratios = [float("nan")]
    print(f"{args.streams} streams, median over {args.rounds} rounds: plain {statistics.median(plain):.1f} tok/s "
          f"({min(plain):.1f}-{max(plain):.1f}), one constrained {statistics.median(constrained):.1f} tok/s "
          f"({min(constrained):.1f}-{max(constrained):.1f}), ratio {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f})")
    off, on = run_interleaved_steps(engine, prompts, args.interleaved_steps)
    print(f"decode steps interleaved in one batch ({len(off)} each): plain {statistics.median(off) * 1e3:.1f} ms "
          f"(tok/s {args.streams / statistics.median(off):.1f}), one constrained {statistics.median(on) * 1e3:.1f} ms "
          f"(tok/s {args.streams / statistics.median(on):.1f}), ratio of tok/s "
          f"{statistics.median(off) / statistics.median(on):.3f}")
    steps = clock.calls["apply"]
    per_step_ms = clock.seconds / max(steps, 1) * 1e3
    print(f"grammar work on the step thread: {per_step_ms:.2f} ms a constrained step over {steps} steps; "
          f"a plain interleaved step took {statistics.median(off) * 1e3:.0f} ms (median), so "
          f"{per_step_ms / (statistics.median(off) * 1e3) * 100:.2f}% of a step")
    engine.close()


if __name__ == "__main__":
    main()
