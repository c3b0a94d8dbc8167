"""One prompt's first token by component, ours against vLLM's CPU backend: where a prefill's time goes on each side.

A fresh prompt of each length, max_tokens 1, greedy, on the random Qwen3-0.6B-shaped checkpoint of
bench_peers.py, one thread each: ours in this process through the engine (LLMEngine.step, so the
real prefill path: the layers in one C call where fused_decode takes the step), vLLM's offline LLM
with its engine core in its own process (peer_vllm_prefill_profile.py, vLLM's venv), both pinned
to the CPUs this process may use (run it under `taskset -c 1`). Each round, for each length, each
side is timed once plain (the TTFT) and once profiled (the components), the order alternating.

- Ours: the kernels decoder.c calls are swapped for timing stand-ins (prefill_timers.c), so the
  fused call splits into its matmuls (by shape), norms, q/k norms with rotary, KV writes and
  attention, the rest of it being the residual adds and copies; the Python calls around it
  (embedding, rotary tables, final norm, LM head, sampler) and the engine's scheduling and input
  building are timed where they are called.
- vLLM: torch.profiler's op table inside its model's forward (leaf ops' self time, inductor's C++
  kernels by name, oneDNN matmuls by shape), ranges around its LM head and sampler.
"Rest" is the profiled first token less every named component. Medians over rounds.

    taskset -c 1 python -m bench.bench_prefill_layers --rounds 5
    taskset -c 1 python -m bench.bench_prefill_layers --lengths 128 --rounds 3 --no-vllm
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import peer_install  # noqa: E402
from bench.bench_engine import ensure_checkpoint  # noqa: E402
from bench.cpu_kind import cpu_description, cpu_kind, cpu_model  # noqa: E402
from bench.prefill_profile_ours import OursProfile  # noqa: E402
from bench.prefill_profile_vllm import vllm_components  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / ".cache" / "peers-qwen3-0.6b"
DRIVER = ROOT / "bench" / "peer_vllm_prefill_profile.py"
ROWS = ("qkv", "o", "gate_up", "down", "attention", "norms", "qk_norm_rotary", "rotary_tables", "kv_write",
        "residual_copies", "embedding", "lm_head", "sampling", "schedule_inputs", "rest")
LABELS = {"qkv": "matmul qkv", "o": "matmul o", "gate_up": "matmul gate_up (+SiLU)", "down": "matmul down",
          "attention": "attention", "norms": "RMS norms (layers, final)", "qk_norm_rotary": "q/k norms + rotary",
          "rotary_tables": "rotary tables (cos/sin)", "kv_write": "KV cache write",
          "residual_copies": "residual adds, copies", "embedding": "embedding", "lm_head": "lm head (last row)",
          "sampling": "sampling", "schedule_inputs": "scheduling, inputs", "rest": "rest (Python, glue)"}


class VllmSide:
    """vLLM's offline engine in its venv's python, answering one request a line."""

    def __init__(self, checkpoint: pathlib.Path, log_path: pathlib.Path, cpu: int):
        python = peer_install.vllm_python()
        if not python.exists():
            raise RuntimeError("vLLM is not installed: python -m bench.bench_peers --install --peers vllm")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cpu)}
        # Its CPU docs: tcmalloc and its bundled Intel OpenMP, preloaded.
        preload = [p for p in [peer_install.tcmalloc(), *map(str, python.parent.parent.glob("lib/libiomp5.so"))] if p]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        limits = {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "max_model_len": 1024,
                  "kv_cache_memory_bytes": 256 << 20, "gpu_memory_utilization": 0.5, "enable_prefix_caching": False}
        print(f"vllm: starting (its log: {log_path}) ...", flush=True)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([str(python), str(DRIVER), str(checkpoint), json.dumps(limits)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        ready = self._read()
        if "error" in ready:
            raise RuntimeError(f"vLLM failed to start: {ready['error']} (see {log_path})")
        self.version = ready["version"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("vLLM's driver exited")
        return json.loads(line)

    def ask(self, mode: str, prompt: list[int]) -> dict:
        self.proc.stdin.write(json.dumps({"mode": mode, "prompt": prompt}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def table(length: int, ours: list[dict], vllm: list[dict], ttft: dict) -> str:
    lines = [f"\n{length}-token prompt: medians over {len(ours)} profiled rounds (ms)",
             f"{'component':<28}{'ours':>10}{'vLLM':>10}{'ours/vLLM':>11}"]
    for row in ROWS + ("profiled total",):
        key = "total" if row == "profiled total" else row
        mine = statistics.median(r[key] for r in ours)
        theirs = statistics.median(r[key] for r in vllm) if vllm else float("nan")
        ratio = f"{mine / theirs:.2f}x" if vllm and theirs > 0.05 else "-"
        lines.append(f"{LABELS.get(row, row):<28}{mine:>10.2f}{theirs:>10.2f}{ratio:>11}")
    o, v = ttft["ours"], ttft["vllm"]
    line = f"TTFT, plain rounds: ours {statistics.median(o):.1f} ms ({min(o):.1f}-{max(o):.1f})"
    if v:
        ratios = [a / b for a, b in zip(o, v)]
        line += (f", vLLM {statistics.median(v):.1f} ms ({min(v):.1f}-{max(v):.1f}); ours/vLLM "
                 f"{statistics.median(ratios):.3f}x (per round {', '.join(f'{r:.2f}' for r in ratios)})")
    lines.append(line)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--lengths", default="128,512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="unrecorded prefills a side and length first")
    p.add_argument("--no-vllm", action="store_true", help="ours alone")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    checkpoint = ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
    ours = OursProfile(checkpoint)
    vocab = ours.vocab_size
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    log_path = pathlib.Path(tempfile.gettempdir()) / "bench_prefill_layers-vllm.log"
    vllm = None if args.no_vllm else VllmSide(checkpoint, log_path, cpus[-1])
    try:
        for n in lengths:
            for _ in range(args.warmup):
                ours.first_token(prompt(n))
                if vllm:
                    vllm.ask("time", prompt(n))
        profiles = {n: {"ours": [], "vllm": []} for n in lengths}
        ttfts = {n: {"ours": [], "vllm": []} for n in lengths}
        for r in range(args.rounds):
            for n in lengths:
                sides = ["ours", "vllm"] if r % 2 == 0 else ["vllm", "ours"]
                for side in sides:
                    if side == "ours":
                        ttfts[n]["ours"].append(ours.first_token(prompt(n)))
                    elif vllm:
                        ttfts[n]["vllm"].append(vllm.ask("time", prompt(n))["ttft_ms"])
                for side in sides:
                    if side == "ours":
                        profiles[n]["ours"].append(ours.profile(prompt(n)))
                    elif vllm:
                        profiles[n]["vllm"].append(vllm_components(vllm.ask("profile", prompt(n))))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n}: ours {ttfts[n]['ours'][-1]:.0f} ms" +
                (f", vLLM {ttfts[n]['vllm'][-1]:.0f} ms" if vllm else "") for n in lengths), flush=True)
    finally:
        if vllm:
            vllm.close()
    print(f"\nCPU: {cpu_description()} [{cpu_kind()}], CPUs {cpus}, 1 thread each; "
          f"vLLM {vllm.version if vllm else '-'}; {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    for n in lengths:
        print(table(n, profiles[n]["ours"], profiles[n]["vllm"], ttfts[n]))
    print(json.dumps({"cpu": cpu_model(), "cpu_kind": cpu_kind(), "lengths": lengths, "ttft_ms": ttfts,
                      "profiles": profiles}))


if __name__ == "__main__":
    main()
