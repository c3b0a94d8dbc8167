"""One line of figures from a benchmark log's last line (its JSON report), for scripts/gpu-check.sh's summary table."""
import json
import sys


def engine(report: dict) -> str:
    result = report["results"]["bfloat16"]
    figures, ratios = result["figures"], result["ratios"]

    def median(name: str) -> float:
        return figures[name]["median"] if name in figures else float("nan")

    line = (f"1 stream: ours {median('ours_decode_tps'):.0f} tok/s, transformers "
            f"{median('transformers_decode_tps'):.0f} ({ratios['decode_speedup_vs_transformers']:.1f}x)")
    streams = report["settings"].get("streams")
    if streams:
        line += (f"; {streams} streams: ours {median('ours_streams_output_tps'):.0f} output tok/s, "
                 f"transformers {median('transformers_streams_output_tps'):.0f}")
    return line


def services(report: dict) -> str:
    return ", ".join(f"{name} {result['decode_tok_s']['median']:.0f}" for name, result in report["results"].items()) \
        + " decode tok/s, 1 stream"


def main() -> None:
    kind, log = sys.argv[1], sys.argv[2]
    try:
        with open(log) as f:
            lines = f.read().strip().splitlines()
        print({"engine": engine, "services": services}[kind](json.loads(lines[-1])))
    except (OSError, IndexError, ValueError, KeyError, TypeError):
        print("no report (see the log)")


if __name__ == "__main__":
    main()
