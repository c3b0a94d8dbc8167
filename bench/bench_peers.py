"""Peer benchmark: ours, vLLM's CPU backend and llama.cpp on the same checkpoint, in one run, alternating rounds.

Served systems (ours: tokenizer + model worker + gateway; vLLM: its OpenAI server) are driven
through the same OpenAI HTTP route, `POST /v1/completions` streamed, with token-id prompts
(fresh random ids every round, so no prefix cache helps), greedy, `ignore_eos`. Workloads:
  - single: one stream at a time (a 128-token prompt, 64 new tokens): decode tok/s and TTFT;
  - mixed16: 16 concurrent streams, prompts 32-512 tokens, outputs 32-128: TTFT p50/p90, tok/s;
  - burst64: 64 requests sent at once (prompts and outputs as --burst-*): TTFT p50/p90, tok/s.
Start-up time is from launching a system to its first completed request. Each round runs every
system once (the order reversed every other round) on the same requests, the single stream request
by request in turns; medians over rounds, ratios ours / peer are medians of per-round ratios.

Placements (`--placement`): `split` pins each engine's compute to one CPU (`--engine-cpu`, ours
through `--engine-cpus`, vLLM through VLLM_CPU_OMP_THREADS_BIND) and runs the fronts and this
client on the others; `default` starts each system as its docs say, unpinned.

llama.cpp (`--peers llama`) runs in its own venv as a child process with the GGUF files made by
`--install`; decode and prefill speed are measured in-process on both sides at `--llama-threads`
threads, alternating with our engine (LLMEngine) in this process.

    python -m bench.bench_peers --install                  # build the peers (once; ~15+ min)
    python -m bench.bench_peers --peers vllm,llama --rounds 3
    python -m bench.bench_peers --quick                    # a smoke check: ours alone, short workloads

Not part of CI. The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import logging
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import peer_install  # noqa: E402
from bench.cpu_kind import cpu_description, cpu_kind, cpu_model  # noqa: E402
from bench.bench_engine import ensure_checkpoint  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / ".cache" / "peers-qwen3-0.6b"
LLAMA_DRIVER = pathlib.Path(__file__).with_name("peer_llama_driver.py")
VOCAB_LOW, VOCAB_HIGH = 1000, 150000  # ordinary BPE tokens of the Qwen3 vocabulary
log = logging.getLogger("bench_peers")


# -- one streamed completion over HTTP ----------------------------------------------------------------


def stream_completion(port: int, prompt: list[int], max_tokens: int, model: str, timeout: float = 1800) -> dict:
    """Send one streamed completion; returns its start, first-token and end times and its token count."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    first = last = None
    tokens = None
    while line := resp.readline():
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        event = json.loads(line[6:])
        if event.get("choices"):
            last = time.perf_counter()
            first = first or last
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    conn.close()
    if tokens != max_tokens or first is None:
        raise RuntimeError(f"got {tokens} tokens for max_tokens {max_tokens}")
    return {"start": start, "first": first, "end": last, "tokens": tokens}


def served_model(port: int) -> str:
    """The model name a server lists at GET /v1/models."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/v1/models")
        return json.loads(conn.getresponse().read())["data"][0]["id"]
    finally:
        conn.close()


def run_concurrent(port: int, model: str, requests: list[tuple[list[int], int]]) -> dict:
    """All requests at once, one thread each; TTFT p50/p90 and output tok/s over the wall time."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: stream_completion(port, r[0], r[1], model), requests))
    wall = time.perf_counter() - start
    ttft = sorted(r["first"] - r["start"] for r in results)
    return {"ttft_p50": statistics.median(ttft), "ttft_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "tok_s": sum(r["tokens"] for r in results) / wall, "wall": wall}


def single_figures(results: list[dict]) -> dict:
    """Streams run one at a time: median TTFT and decode tok/s (tokens after the first over their time)."""
    return {"ttft": statistics.median(r["first"] - r["start"] for r in results),
            "decode_tok_s": statistics.median((r["tokens"] - 1) / (r["end"] - r["first"]) for r in results)}


def run_single(port: int, model: str, requests: list[tuple[list[int], int]]) -> dict:
    """One stream at a time: single_figures."""
    return single_figures([stream_completion(port, prompt, max_tokens, model) for prompt, max_tokens in requests])


# -- the served systems -------------------------------------------------------------------------------


class Served:
    """A system behind an OpenAI HTTP port: started once, timed from launch to its first completion."""

    model = ""  # as the server lists it at /v1/models

    def __init__(self, name: str, checkpoint: pathlib.Path, args, log_dir: pathlib.Path):
        self.name, self.checkpoint, self.args, self.log_dir = name, checkpoint, args, log_dir
        self.startup_s: float | None = None

    def wait_ready(self, launched: float, timeout: float = 1800) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                self.model = served_model(self.port)
                stream_completion(self.port, [VOCAB_LOW] * 8, 2, self.model, timeout=600)
                break
            except (OSError, RuntimeError, http.client.HTTPException):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not serving after {timeout} s") from None
                time.sleep(1)
        self.startup_s = time.perf_counter() - launched


    def pids(self) -> list[int]:
        raise NotImplementedError

    def pause(self) -> None:
        """SIGSTOP every process of the system while another one is measured.

        An idle vLLM busy-polls: its engine core spins on the engine's CPU, so a system measured
        beside a running one would get half that CPU. Stopped, it takes none.
        """
        for pid in self.pids():
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self.pids():
            os.kill(pid, signal.SIGCONT)


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in pathlib.Path(f"/proc/{p}/task").glob("*/children"):
            todo.extend(int(c) for c in task.read_text().split())
    return out


class Ours(Served):
    def start(self) -> None:
        from tests.integration.stack import free_port, make_stack

        self.port = free_port()
        worker_flags = ["--dtype", "bfloat16"]
        if self.args.placement == "split":
            worker_flags += ["--engine-cpus", str(self.args.engine_cpu)]
        self.stack = make_stack(str(self.checkpoint), str(self.log_dir), worker_flags=worker_flags,
                                gateway_flags=["--http-port", str(self.port)])
        if self.args.placement == "split":
            # The worker starts on both and moves its own front off the engine's CPU (--engine-cpus).
            self.stack.tokenizer.cpus = self.stack.gateway.cpus = frozenset(self.args.front_cpus)
            self.stack.worker.cpus = frozenset([*self.args.front_cpus, self.args.engine_cpu])
        launched = time.perf_counter()
        self.stack.start(timeout=600)
        self.wait_ready(launched)

    def check_alive(self) -> None:
        for service in self.stack.services:
            if service.process.poll() is not None:
                raise RuntimeError(f"{service.name} exited:\n{service.log()[-3000:]}")

    def pids(self) -> list[int]:
        return [p for service in self.stack.services for p in process_tree(service.process.pid)]

    def stop(self) -> None:
        self.stack.stop()


class VLLM(Served):
    def start(self) -> None:
        from tests.integration.stack import free_port

        self.port = free_port()
        python = peer_install.vllm_python()
        if not python.exists():
            raise SystemExit("vLLM is not installed: run python -m bench.bench_peers --install --peers vllm")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONUNBUFFERED": "1"}
        # Its CPU docs: tcmalloc and its bundled Intel OpenMP, preloaded.
        preload = [p for p in [peer_install.tcmalloc(), *map(str, python.parent.parent.glob("lib/libiomp5.so"))] if p]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        if self.args.placement == "split":
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.args.engine_cpu)
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.checkpoint),
               "--dtype", "bfloat16", "--max-model-len", "4096",
               "--host", "127.0.0.1", "--port", str(self.port)]
        launched = time.perf_counter()
        self.log_file = open(self.log_dir / "vllm.log", "ab")
        preexec = None
        if self.args.placement == "split":
            front = set(self.args.front_cpus) | {self.args.engine_cpu}  # its engine core binds itself to engine_cpu
            preexec = lambda: os.sched_setaffinity(0, front)  # noqa: E731
        self.process = subprocess.Popen(cmd, env=env, stdout=self.log_file, stderr=subprocess.STDOUT,
                                        preexec_fn=preexec, start_new_session=True)
        self.wait_ready(launched)

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {self.process.returncode}: see {self.log_dir / 'vllm.log'}")

    def pids(self) -> list[int]:
        return process_tree(self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()


# -- workloads ----------------------------------------------------------------------------------------


def make_requests(rng: random.Random, count: int, prompt_range, output_range) -> list[tuple[list[int], int]]:
    return [([rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(*prompt_range))],
             rng.randint(*output_range)) for _ in range(count)]


def workloads(args) -> dict:
    return {
        "single": (run_single, dict(count=args.single_requests, prompt=(args.single_prompt,) * 2,
                                    output=(args.single_output,) * 2)),
        "mixed16": (run_concurrent, dict(count=args.streams, prompt=tuple(args.prompt_tokens),
                                         output=tuple(args.output_tokens))),
        "burst64": (run_concurrent, dict(count=args.burst, prompt=tuple(args.burst_prompt_tokens),
                                         output=tuple(args.burst_output_tokens))),
    }


def warm(system: Served, timeout: float = 60) -> None:
    """One short untimed request, retried while the server answers 503: a system just resumed reconnects
    its own channels, and our gateway answers "retry shortly" until its health check of the worker,
    frozen with it, has run again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stream_completion(system.port, [VOCAB_LOW] * 8, 2, system.model)
            return
        except RuntimeError as e:
            if not str(e).startswith("HTTP 503") or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def alone(systems: dict[str, Served], name: str, run):
    """run(system) with every other system paused, after warm()."""
    others = [s for n, s in systems.items() if n != name]
    for other in others:
        other.pause()
    try:
        warm(systems[name])
        return run(systems[name])
    finally:
        for other in others:
            other.resume()


def serve_rounds(systems: dict[str, Served], args) -> dict:
    """Every workload, every round, every system in turn on the same requests.

    The single stream takes turns request by request (the order flipping each request): this machine's
    speed drifts over seconds, its matrix unit's most (docs/peers.md, "What is left"), and all of one
    system's requests and then all of the other's met two different machines."""
    figures: dict[str, dict[str, list[dict]]] = {name: {w: [] for w in args.workloads} for name in systems}
    names = list(systems)
    for r in range(args.rounds):
        for w in args.workloads:
            run, spec = workloads(args)[w]
            requests = make_requests(random.Random(f"{args.seed}-{r}-{w}"), spec["count"], spec["prompt"],
                                     spec["output"])
            order = names if r % 2 == 0 else names[::-1]
            if run is run_single:
                streams: dict[str, list[dict]] = {name: [] for name in order}
                for j, (prompt, max_tokens) in enumerate(requests):
                    for name in (order if j % 2 == 0 else order[::-1]):
                        streams[name].append(alone(systems, name, lambda s, p=prompt, m=max_tokens: stream_completion(
                            s.port, p, m, s.model)))
                results = {name: single_figures(streams[name]) for name in order}
            else:
                results = {name: alone(systems, name, lambda s, q=requests: run(s.port, s.model, q)) for name in order}
            for name, res in results.items():
                figures[name][w].append(res)
                print(f"round {r} {w:8s} {name:5s} " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
    return figures


# -- llama.cpp, in-process on both sides --------------------------------------------------------------


class LlamaPeer:
    """llama-cpp-python in its own venv, as a child process that measures when asked (bench/peer_llama_driver.py)."""

    def __init__(self, gguf: pathlib.Path, threads: int, flash: bool):
        python = peer_install.llama_python()
        if not python.exists():
            raise SystemExit("llama.cpp is not installed: run python -m bench.bench_peers --install --peers llama")
        self.proc = subprocess.Popen([str(python), str(LLAMA_DRIVER), str(gguf), str(threads), str(int(flash))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(self.proc.stdout.readline())
        self.startup_s = ready["load_s"]

    def measure(self, prompt: list[int], decode_tokens: int, prefill: list[int]) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "decode": decode_tokens, "prefill": prefill}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:  # e.g. SIGILL: a build whose Q8_0 path uses AMX instructions this machine refuses
            raise RuntimeError(f"llama.cpp exited with {self.proc.wait()}")
        return json.loads(line)

    def pause(self) -> None:
        """Stopped while another system is measured: its threads would otherwise spin on the same CPUs."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(60)



def ours_in_process(checkpoint: pathlib.Path, threads: int, quantization: str = "none"):
    import torch

    from services.model_worker.config.engine import EngineConfig
    from services.model_worker.config.sampling import SamplingParams
    from services.model_worker.engine.llm_engine import LLMEngine

    torch.set_num_threads(threads)
    # 8-bit: every linear layer, the vocab projection included, as llama.cpp's Q8_0 file holds them.
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", enable_prefix_caching=False,
                                                quantization=quantization, quantize_lm_head=quantization != "none",
                                                kv_cache_bytes=512 << 20))

    def measure(prompt: list[int], decode_tokens: int, prefill: list[int]) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
        engine.add_request("d", prompt, params)
        times = []
        while engine.has_work():
            engine.step()
            times.append(time.perf_counter())
        decode = (len(times) - 1) / (times[-1] - times[0])
        start = time.perf_counter()
        engine.generate([prefill], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        return {"decode_tok_s": decode, "prefill_tok_s": len(prefill) / (time.perf_counter() - start)}

    return engine, measure


def llama_rounds(checkpoint: pathlib.Path, args) -> dict:
    engines, ours = [], {}
    for quantization in args.ours_quantization.split(","):
        engine, measure = ours_in_process(checkpoint, args.llama_threads, quantization)
        engines.append(engine)
        ours["ours" if quantization == "none" else f"ours-{quantization}"] = measure
    peers = {kind: LlamaPeer(peer_install.gguf_path(checkpoint, kind), args.llama_threads, args.llama_flash)
             for kind in peer_install.GGUF_TYPES}
    systems = {**ours, **{f"llama-{k}": p.measure for k, p in peers.items()}}
    figures: dict[str, list[dict]] = {name: [] for name in systems}
    failed: set[str] = set()
    rng = random.Random(args.seed)
    for measure in ours.values():
        measure(make_requests(rng, 1, (32, 32), (1, 1))[0][0], 4, [VOCAB_LOW] * 64)  # warm-up
    for r in range(args.rounds):
        prompt = make_requests(rng, 1, (args.single_prompt,) * 2, (1, 1))[0][0]
        prefill = make_requests(rng, 1, (args.prefill_tokens,) * 2, (1, 1))[0][0]
        names = list(systems) if r % 2 == 0 else list(systems)[::-1]
        for name in names:
            if name in failed:
                continue
            for kind, peer in peers.items():
                if f"llama-{kind}" != name and peer.proc.poll() is None:
                    peer.pause()
            try:
                res = systems[name](prompt, args.single_output, prefill)
            except RuntimeError as e:
                print(f"round {r} in-process {name}: FAILED ({e}); left out from here on", flush=True)
                failed.add(name)
                continue
            finally:
                for peer in peers.values():
                    if peer.proc.poll() is None:
                        peer.resume()
            figures[name].append(res)
            print(f"round {r} in-process {name:10s} decode {res['decode_tok_s']:.1f} tok/s, "
                  f"prefill({args.prefill_tokens}) {res['prefill_tok_s']:.0f} tok/s", flush=True)
    for peer in peers.values():
        peer.close()
    for engine in engines:
        engine.close()
    return {name: runs for name, runs in figures.items() if name not in failed and runs}


# -- summary ------------------------------------------------------------------------------------------


def summarize(served: dict, in_process: dict) -> dict:
    out: dict = {"served": {}, "in_process": {}}
    for name, per_workload in served.items():
        out["served"][name] = {w: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                               for w, runs in per_workload.items() if runs}
    for name, runs in in_process.items():
        out["in_process"][name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratios: dict = {}
    if "ours" in served:
        for peer in (p for p in served if p != "ours"):
            for w, runs in served["ours"].items():
                for k in (runs[0] if runs else {}):
                    ratios[f"{w}.{k}.ours/{peer}"] = statistics.median(
                        a[k] / b[k] for a, b in zip(runs, served[peer][w]))
    for mine in (p for p in in_process if p.startswith("ours")):
        for peer in (p for p in in_process if not p.startswith("ours")):
            for k in in_process[mine][0]:
                ratios[f"in_process.{k}.{mine}/{peer}"] = statistics.median(
                    a[k] / b[k] for a, b in zip(in_process[mine], in_process[peer]))
    out["ratios"] = ratios
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", action="store_true", help="build the peers' venvs and GGUF files, then exit")
    p.add_argument("--peers", default="vllm,llama", help="comma list of vllm, llama (empty: ours alone)")
    p.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--placement", choices=("split", "default"), default="split")
    p.add_argument("--engine-cpu", type=int, default=1, help="split: the CPU each engine computes on")
    p.add_argument("--front-cpus", default="0", help="split: the CPUs of the fronts and this client")
    p.add_argument("--workloads", default="single,mixed16,burst64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--single-requests", type=int, default=3)
    p.add_argument("--single-prompt", type=int, default=128)
    p.add_argument("--single-output", type=int, default=64)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=(32, 512))
    p.add_argument("--output-tokens", type=int, nargs=2, default=(32, 128))
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--burst-prompt-tokens", type=int, nargs=2, default=(32, 128))
    p.add_argument("--burst-output-tokens", type=int, nargs=2, default=(32, 128))
    p.add_argument("--llama-threads", type=int, default=2)
    p.add_argument("--llama-flash", action="store_true", help="llama.cpp with its flash attention")
    p.add_argument("--ours-quantization", default="none",
                   help="beside llama.cpp: our engine with these --quantization values, e.g. none,int8")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="ours alone, tiny workloads: checks the script works")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(f"CPU: {cpu_description()}, kind {cpu_kind()}, {os.cpu_count()} CPUs", flush=True)
    peers = {x for x in args.peers.split(",") if x}
    if args.quick:
        peers, args.rounds, args.single_requests, args.streams, args.burst = set(), 1, 1, 4, 6
        args.single_output, args.prompt_tokens, args.burst_prompt_tokens = 8, (16, 64), (16, 32)
        args.output_tokens = args.burst_output_tokens = (4, 8)
    checkpoint = ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
    if args.install:
        peer_install.install(checkpoint, peers)
        return
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.front_cpus = [int(c) for c in args.front_cpus.split(",")]
    if args.placement == "split":
        os.sched_setaffinity(0, set(args.front_cpus))  # this client stays off the engines' CPU
    served: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        systems: dict[str, Served] = {"ours": Ours("ours", checkpoint, args, pathlib.Path(tmp))}
        if "vllm" in peers:
            systems["vllm"] = VLLM("vllm", checkpoint, args, pathlib.Path(tmp))
        try:
            for system in systems.values():
                for other in systems.values():  # the ones started so far wait, stopped
                    if other is not system and other.startup_s is not None:
                        other.pause()
                system.start()
                for other in systems.values():
                    if other is not system and other.startup_s is not None:
                        other.resume()
                print(f"{system.name}: start to first completion {system.startup_s:.1f} s", flush=True)
            if args.workloads:
                served = serve_rounds(systems, args)
        finally:
            for system in systems.values():
                if hasattr(system, "stack") or hasattr(system, "process"):
                    system.stop()
        startup = {name: s.startup_s for name, s in systems.items()}
    in_process: dict = {}
    if "llama" in peers:
        if args.placement == "split":
            os.sched_setaffinity(0, set(range(os.cpu_count())))  # both sides get the same threads
        in_process = llama_rounds(checkpoint, args)
    summary = summarize(served, in_process)
    for key, value in summary["ratios"].items():
        print(f"{key}: {value:.2f}x")
    # cpu_kind files the figures: docs/peers.md keeps one table per kind (AMX Xeons, AVX512-only Zen 4).
    print(json.dumps({"bench": "peers", "cpu": cpu_model(), "cpu_kind": cpu_kind(), "cpu_flags": cpu_description(),
                      "cpus": os.cpu_count(), "placement": args.placement,
                      "rounds": args.rounds, "startup_s": startup, **summary}))


if __name__ == "__main__":
    main()
