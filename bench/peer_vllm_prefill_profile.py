"""vLLM's side of bench_prefill_layers.py, run by the python of vLLM's own venv: one prompt's first token, timed or
profiled by component with torch.profiler.

argv: checkpoint directory, then a JSON object of engine limits. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller) so that one profiler sees its scheduling, input
building, model, logits and sampling; inductor's C++ kernels carry their names into the profile
(TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1). Prints one JSON line once loaded ({"load_s", "version"} or
{"error": why}), then answers each JSON line on stdin ({"mode": "time" | "profile", "prompt": [ids]}) with
{"ttft_ms"} and, when profiled, {"ops": {name: [self ms, calls]}, "ranges": {name: ms}}: the self times of
the ops inside the model's forward (a matmul's name followed by its first input shapes), and the wall time
of the ranges named below.
"""
import json
import os
import sys
import time

# The wrapped calls, each a record_function range in the profile (their ops are counted under it).
RANGES = ("forward", "lm_head", "sampling")


def wrap_ranges() -> None:
    """Named profiler ranges around the model's forward, its vocabulary projection and the sampler."""
    import torch
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.v1.sample.sampler import Sampler

    def ranged(cls, method: str, name: str) -> None:
        inner = getattr(cls, method)

        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(name):
                return inner(*args, **kwargs)
        setattr(cls, method, wrapper)

    ranged(Qwen3ForCausalLM, "forward", "forward")
    ranged(LogitsProcessor, "forward", "lm_head")
    ranged(Sampler, "forward", "sampling")


def first_token(llm, prompt: list[int]) -> float:
    """Milliseconds from handing vLLM the prompt to its first token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return (time.perf_counter() - start) * 1e3


def profiled(llm, prompt: list[int]) -> dict:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        ttft = first_token(llm, prompt)
    ops, ranges = {}, {name: 0.0 for name in RANGES}
    for event in prof.events():
        if event.name in ranges:
            ranges[event.name] += event.cpu_time_total / 1e3
            continue
        parent, inside = event.cpu_parent, False
        while parent is not None:
            if parent.name == "forward":
                inside = True
                break
            parent = parent.cpu_parent
        if not inside:
            continue
        shapes = [list(s) for s in event.input_shapes[:3]] if event.input_shapes else []
        key = f"{event.name} {json.dumps(shapes)}" if "mm" in event.name or "linear" in event.name else event.name
        entry = ops.setdefault(key, [0.0, 0])
        entry[0] += event.self_cpu_time_total / 1e3
        entry[1] += 1
    return {"ttft_ms": ttft, "ops": ops, "ranges": ranges}


def main() -> None:
    # The answers keep the original stdout; everything vLLM prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def answer(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    checkpoint, limits = sys.argv[1], json.loads(sys.argv[2])
    start = time.perf_counter()
    try:
        import vllm
        from vllm import LLM

        wrap_ranges()
        llm = LLM(model=checkpoint, skip_tokenizer_init=True, dtype="bfloat16", seed=0, **limits)
    except Exception as e:  # noqa: BLE001 - the benchmark prints why, and goes on without vLLM
        answer({"error": f"{type(e).__name__}: {e}"})
        return
    answer({"load_s": time.perf_counter() - start, "version": vllm.__version__})
    for line in sys.stdin:
        ask = json.loads(line)
        if ask["mode"] == "profile":
            answer(profiled(llm, ask["prompt"]))
        else:
            answer({"ttft_ms": first_token(llm, ask["prompt"])})


if __name__ == "__main__":
    main()
