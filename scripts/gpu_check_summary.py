"""One line of figures from a benchmark log's last JSON line (its report), for scripts/gpu-check.sh's summary table."""
import json
import sys

# Goals on one H200 for the 0.6B shape in bf16, judged where a GPU run measured that figure.
ONE_STREAM_TPS = 1000.0
STREAMS_GOAL = (256, 40_000.0)     # concurrent streams, output tok/s
LONG_CONTEXT_GOAL = (16384, 1.3)   # context, its time per token over the short context's


def verdict(value: float, goal: float, at_least: bool = True) -> str:
    met = value >= goal if at_least else value <= goal
    return f"goal {'>=' if at_least else '<='} {goal:g}: {'met' if met else 'MISSED'}"


def engine(report: dict) -> str:
    result = report["results"]["bfloat16"]
    figures, ratios, settings = result["figures"], result["ratios"], report["settings"]
    on_gpu = settings.get("device", "cpu") != "cpu"

    def median(name: str) -> float:
        return figures[name]["median"] if name in figures else float("nan")

    one = median("ours_decode_tps")
    line = f"1 stream: ours {one:.0f} tok/s"
    if on_gpu:
        line += f" ({verdict(one, ONE_STREAM_TPS)})"
    line += (f", transformers {median('transformers_decode_tps'):.0f} "
             f"({ratios['decode_speedup_vs_transformers']:.1f}x)")
    streams = settings.get("streams")
    if streams:
        many = median("ours_streams_output_tps")
        line += f"; {streams} streams: ours {many:.0f} output tok/s"
        if on_gpu and streams == STREAMS_GOAL[0]:
            line += f" ({verdict(many, STREAMS_GOAL[1])})"
        line += f", transformers {median('transformers_streams_output_tps'):.0f}"
    if "ours_ms_per_token_ctx_long" in figures:
        long, ratio = settings["long_context"], ratios["ctx2048_vs_ctx64_time_per_token"]
        line += (f"; ms a token at context {settings['short_context']} / {long}: "
                 f"{median('ours_ms_per_token_ctx_short'):.2f} / {median('ours_ms_per_token_ctx_long'):.2f} "
                 f"({ratio:.2f}x")
        if on_gpu and long == LONG_CONTEXT_GOAL[0]:
            line += f", {verdict(ratio, LONG_CONTEXT_GOAL[1], at_least=False)}"
        line += ")"
    return line


def variants(report: dict) -> str:
    """bench_engine_variants: each variant's tok/s per stream count, the others' ratio and tokens against the first."""
    names = report["variants"]
    parts = []
    for n, res in report["results"].items():
        label = "1 stream" if n == "1" else f"{n} streams"
        tps = ", ".join(f"{name} {res['tps'][name]['median']:.0f}" for name in names)
        part = f"{label}: {tps} {res['unit']}"
        others = []
        for name in names[1:]:
            same = res["identical_streams_per_round"][name]
            others.append(f"{name}/{names[0]} {res['ratio_vs_first'][name]:.2f}x, "
                          f"{sum(same)}/{int(n) * len(same)} streams' tokens identical")
        if others:
            part += f" ({'; '.join(others)})"
        parts.append(part)
    for name, s in report.get("speculation", {}).items():
        parts.append(f"{name}: {s['tokens_per_pass']:.2f} tokens a pass, acceptance {s['acceptance_rate']:.2f}")
    return "; ".join(parts)


def services(report: dict) -> str:
    return ", ".join(f"{name} {result['decode_tok_s']['median']:.0f}" for name, result in report["results"].items()) \
        + " decode tok/s, 1 stream"


def main() -> None:
    kind, log = sys.argv[1], sys.argv[2]
    try:
        with open(log) as f:
            lines = f.read().strip().splitlines()
        # The report is the last JSON line: a check that fails after it may print its reason below.
        report = next((line for line in reversed(lines) if line.startswith("{")), "")
        print({"engine": engine, "variants": variants, "services": services}[kind](json.loads(report)))
    except (OSError, IndexError, ValueError, KeyError, TypeError):
        print("no report (see the log)")


if __name__ == "__main__":
    main()
