"""vLLM's side of bench_host.py, run by the python of vLLM's own venv: its offline `LLM` class, measuring when asked.

argv: checkpoint directory, then a JSON object of engine limits (max_num_seqs, max_num_batched_tokens,
max_model_len). Prints one JSON line once loaded ({"load_s", "version"}, or {"unsupported": why} when
vLLM cannot run the checkpoint's shape, or {"error": why}), then answers each JSON line on stdin
({"mode", "prompts", "max_tokens", "temperature", "top_p"}) with one JSON line:
  - mode "steps": the requests added as `LLM.generate` adds them, then `llm_engine.step()` until none is
    left, as `LLM.generate` loops, but with per-step (DELTA) outputs so that each step's tokens are counted:
    {"start", "steps": [[end time, tokens, first tokens], ...]};
  - mode "generate": one `LLM.generate` call over every prompt: {"seconds", "tokens"}.
Token-id prompts, so no tokenizer is loaded (skip_tokenizer_init). vLLM's own logs go to stderr.
"""
import json
import os
import sys
import time


def unsupported_shape(checkpoint: str) -> str | None:
    """Why vLLM's CPU attention cannot run this checkpoint, if it cannot: it fails at the first step otherwise."""
    import vllm
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim in sizes:
        return None
    return (f"vLLM {vllm.__version__}'s CPU attention (CPUAttentionBackend) supports head sizes {sizes}; this "
            f"checkpoint's head_dim is {head_dim}, and its first step fails with \"Unsupported CPU attention "
            f"configuration: head_dim={head_dim}\"")


def run_steps(llm, prompts, params) -> dict:
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.DELTA
    engine = llm.llm_engine
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{start}-{i}", prompt, params.clone())
    steps, seen = [], set()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        firsts = 0
        if len(seen) < len(prompts):
            for output in outputs:
                if output.request_id not in seen:
                    seen.add(output.request_id)
                    firsts += 1
        steps.append([now, sum(len(o.outputs[0].token_ids) for o in outputs), firsts])
    return {"start": start, "steps": steps}


def run_generate(llm, prompts, params) -> dict:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}


def main() -> None:
    # The answers keep the original stdout; everything vLLM and its child processes print goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def answer(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    checkpoint, limits = sys.argv[1], json.loads(sys.argv[2])
    start = time.perf_counter()
    try:
        why = unsupported_shape(checkpoint)
        if why:
            answer({"unsupported": why})
            return
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=checkpoint, skip_tokenizer_init=True, dtype="bfloat16", seed=0, **limits)
    except Exception as e:  # noqa: BLE001 - the benchmark prints why, and goes on without vLLM
        answer({"error": f"{type(e).__name__}: {e}"})
        return
    answer({"load_s": time.perf_counter() - start, "version": vllm.__version__})
    for line in sys.stdin:
        ask = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in ask["prompts"]]
        params = SamplingParams(temperature=ask["temperature"], top_p=ask["top_p"], max_tokens=ask["max_tokens"],
                                ignore_eos=True, detokenize=False)
        run = run_steps if ask["mode"] == "steps" else run_generate
        answer(run(llm, prompts, params))


if __name__ == "__main__":
    main()
