"""Chaos benchmark: soak's exactly checked streams while processes of the stack are SIGKILLed and restarted.

    python -m bench.chaos                                    # 16 streams, 10 minutes, a kill every 15 s
    python -m bench.chaos --streams 8 --minutes 2 --kill-every 10 --kinds engine-core,worker --seed 3

It builds the tiny demo checkpoint and starts one gateway, two workers and two tokenizers on free
loopback ports, the gateway given both workers and both tokenizers. N client loops run soak's greedy
and seeded requests, each stream checked token by token and in text against the request's output
run alone. Every --kill-every seconds one process is SIGKILLed: a kind drawn from --kinds (engine
core, worker, tokenizer, gateway), then, once every process of that kind and the gateway serve, one
process of that kind. A killed worker, tokenizer or gateway is started again on its port after
--restart-delay seconds; a worker restarts its own engine core. A stream broken by a gateway kill is started again by its
client; a stream broken by any other kill counts as broken. Each kill is shown as a row while it
runs; the last line printed is one JSON object with every kill, the totals and "ok".
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

import grpc

from bench.chaos_kills import KINDS, RESTARTABLE, Kill, KillLog, Pause, by_kind, failures
from bench.chaos_stack import ChaosStack, Process
from bench.cpu_kind import cpu_description
from bench.soak import Tally, Variant, build_demo_checkpoint, classify, expected_outputs, make_variants, worker_pool
from vllm_v0.gateway.v1 import gateway_pb2_grpc

# A client reconnects to a restarted gateway within a tenth of a second, not after gRPC's back-off (1 s, growing),
# so a gateway kill's pauses measure the gateway's restart, not the client's wait.
CLIENT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 100)]
# The gateway looks at its workers and tokenizers this often (seconds) instead of every second.
GATEWAY_FLAGS = ["--health-interval", "0.25"]
MAX_BAD_EXAMPLES = 20
WORKER_FLAGS = ["--max-waiting", "1024", "--kv-cache-bytes", "64MiB"]
ROW = "{n:>3} {at_s:>7.1f}  {kind:<11} {target:<11} {pid:>7} {open:>5} {broken:>6} {restarted:>9} {pause:>9} {limit:>7} " \
      "{back:>6} {recovery:>8} {orphans:>7}"
HEADER = ROW.replace(":>7.1f", ":>7").format(n="#", at_s="at s", kind="kind", target="target", pid="pid", open="open",
                                             broken="broken", restarted="restarted", pause="pause s", limit="limit",
                                             back="back s", recovery="recover", orphans="orphans")


@dataclass
class ChaosConfig:
    streams: int = 16
    minutes: float = 10.0
    kill_every: float = 15.0
    restart_delay: float = 1.0
    kinds: tuple[str, ...] = KINDS
    in_turn: bool = False        # take --kinds in turn instead of at random
    seed: int = 0
    timeout: float = 120.0       # each request's deadline, from its first call
    max_tokens: int | None = None
    within_s: float = 5.0        # a failure this soon after a kill is blamed on it
    window_s: float = 5.0        # pauses are measured this long after a kill
    worker_flags: list[str] = field(default_factory=list)
    gateway_flags: list[str] = field(default_factory=list)
    max_kills: int | None = None  # stop killing after this many (None: until the end)


@dataclass
class Stream:
    """One request's life at a client, across the calls a gateway kill makes it start again."""
    id: int
    opened_at: float
    last: float                                    # its latest message, or its call's start
    pauses: list[Pause] = field(default_factory=list)
    kills: list[int] = field(default_factory=list)        # the kills it was open at
    restarted_for: set[int] = field(default_factory=set)  # gateway kills it was started again after

    def message(self, now: float) -> None:
        self.last = now
        for pause in self.pauses:
            pause.message(now)

    def end(self, broken: bool = False) -> None:
        for pause in self.pauses:
            pause.end(broken)


class Run:
    """What the client loops and the killer share."""

    def __init__(self, config: ChaosConfig):
        self.kills = KillLog(config.within_s)
        self.open: dict[int, Stream] = {}
        self.ids = itertools.count()
        self.tally = Tally()
        self.broken_unattributed = 0
        self.refused = 0  # calls made after a gateway kill that failed while it restarted
        self.bad: list[str] = []  # the first few streams that ended with the wrong tokens or text, described
        self.started = time.monotonic()


def describe_bad(ids: list[int], want, label: str, variant: Variant, kills: list[int]) -> str:
    first_diff = next((i for i, (a, b) in enumerate(zip(ids, want.token_ids)) if a != b),
                      min(len(ids), len(want.token_ids)))
    sampling = "greedy" if variant.seed is None else f"seed {variant.seed}"
    return (f"{label} ({sampling}): {len(ids)} tokens vs {len(want.token_ids)}, first difference at token "
            f"{first_diff}; open at kills {kills or 'none'}")


async def run_request(stub, run: Run, variant: Variant, want, label: str, timeout: float) -> None:
    """One request to its end, started again after a gateway kill; tallies what came back."""
    now = time.monotonic()
    stream = Stream(next(run.ids), now, now)
    run.open[stream.id] = stream
    try:
        while True:
            ids, text, finish, call_start = [], "", 0, time.monotonic()
            try:
                remaining = stream.opened_at + timeout - call_start
                async for message in stub.Generate(variant.request(), timeout=max(remaining, 0.1)):
                    stream.message(time.monotonic())
                    ids.extend(message.token_ids)
                    text += message.text
                    finish = message.finish_reason or finish
                error = None if finish else "cut"
            except grpc.aio.AioRpcError as e:
                error = e.code().name
            now = time.monotonic()
            if error is None:
                stream.end()
                run.tally.done += 1
                run.tally.tokens += len(ids)
                before = run.tally.correct
                classify(ids, text, want, run.tally, label)
                if run.tally.correct > before:
                    run.kills.recovered(now, call_start)
                elif len(run.bad) < MAX_BAD_EXAMPLES:
                    run.bad.append(describe_bad(ids, want, label, variant, stream.kills))
                return
            if ids != want.token_ids[:len(ids)] or not want.text.startswith(text):
                run.tally.bad_prefix += 1
                run.tally.first_bad = run.tally.first_bad or f"{label}: a broken stream is not a prefix"
            kill = run.kills.blame(now, stream.opened_at)
            if kill is not None and kill.kind in RESTARTABLE and now < stream.opened_at + timeout:
                if stream.id in kill.pauses and kill.n not in stream.restarted_for:
                    stream.restarted_for.add(kill.n)
                    kill.restarted += 1
                    run.tally.errors[error] += 1
                else:  # a call after the kill, while the gateway restarts
                    run.refused += 1
                await asyncio.sleep(0.05)  # the gateway may still be down: no tight loop
                continue
            run.tally.errors[error] += 1
            stream.end(broken=True)
            if error == "cut":
                run.tally.cut += 1
            if kill is None:
                run.broken_unattributed += 1
            else:
                kill.broken += 1
            return
    finally:
        del run.open[stream.id]


async def client_loop(stub, run: Run, variants: list[Variant], wants, stop_at: float, rng: random.Random,
                      timeout: float) -> None:
    while time.monotonic() < stop_at:
        i = rng.randrange(len(variants))
        await run_request(stub, run, variants[i], wants[i], f"variant {i}", timeout)


def print_row(kill: Kill, now: float) -> None:
    r = kill.row(now)

    def num(value):
        return "-" if value is None else f"{value:.2f}"
    print(ROW.format(n=r["n"], at_s=r["at_s"], kind=r["kind"], target=r["target"], pid=r["pid"], open=r["open"],
                     broken=r["broken"], restarted=r["restarted"], pause=num(r["max_pause_s"]),
                     limit=num(r["pause_limit_s"]), back=num(r["back_s"]), recovery=num(r["recovery_s"]),
                     orphans=r["orphans"]), flush=True)


async def follow(stack: ChaosStack, kill: Kill, target: Process, left: list[int], config: ChaosConfig) -> None:
    """Restart what was killed (a worker restarts its own core), note when it serves, and sweep what it left."""
    deadline = kill.at + 120
    if kill.kind != "engine-core":
        await asyncio.to_thread(target.popen.wait)
        await asyncio.sleep(max(0.0, kill.at + config.restart_delay - time.monotonic()))
        target.start()
    kill.back_at = await stack.back(kill.kind, target, kill.pid, deadline)
    await asyncio.sleep(max(0.0, kill.at + 3 - time.monotonic()))  # time to notice its parent is gone
    kill.orphans = stack.sweep(left)


async def killer(stack: ChaosStack, run: Run, config: ChaosConfig, stop_at: float) -> None:
    rng = random.Random(config.seed)
    followers: list[asyncio.Task] = []
    margin = min(config.kill_every, 5.0)  # the last kill leaves time to see its effect
    next_at = time.monotonic() + config.kill_every
    n = 0
    while config.max_kills is None or n < config.max_kills:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        kind = config.kinds[n % len(config.kinds)] if config.in_turn else rng.choice(config.kinds)
        if time.monotonic() + margin > stop_at or not await stack.wait_ready_for(kind, stop_at - margin):
            break
        target = rng.choice(stack.targets(kind))
        others = await stack.others_serving(kind, target)
        try:
            pid, left = stack.kill(kind, target)
        except (RuntimeError, ProcessLookupError):  # it died on its own since it was seen serving: try again
            next_at = time.monotonic() + 0.5
            continue
        now = time.monotonic()
        n += 1
        kill = Kill(n, kind, target.name, pid, now, now - run.started, others)
        for stream in run.open.values():
            kill.pauses[stream.id] = pause = Pause(stream.last, now, config.window_s)
            stream.pauses.append(pause)
            stream.kills.append(n)
        run.kills.add(kill)
        followers.append(asyncio.create_task(follow(stack, kill, target, left, config)))
        if n > 1:
            print_row(run.kills.kills[-2], now)
        next_at = now + config.kill_every
    await asyncio.gather(*followers)


async def chaos(stack: ChaosStack, config: ChaosConfig) -> dict:
    """Start the stack, run the streams and the kills, and gather every count (the stack is left to stop)."""
    begun = time.monotonic()
    await stack.start()
    started = time.monotonic()
    variants = make_variants(random.Random(config.seed), config.max_tokens)
    async with grpc.aio.insecure_channel(stack.gateway.address, options=CLIENT_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        wants = await expected_outputs(stub, variants, config.timeout)
        print(f"stack serving in {started - begun:.1f} s; {len(wants)} expected outputs in "
              f"{time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
        run = Run(config)
        stop_at = run.started + config.minutes * 60
        print(HEADER, flush=True)
        await asyncio.gather(killer(stack, run, config, stop_at),
                             *(client_loop(stub, run, variants, wants, stop_at, random.Random(config.seed + 1 + n),
                                           config.timeout) for n in range(config.streams)))
        elapsed = time.monotonic() - run.started
    now = time.monotonic()
    print(f"after the run:\n{HEADER}", flush=True)  # each row again, now that every stream has ended
    for kill in run.kills.kills:
        print_row(kill, now)
    whole = await stack.wait_whole(now + 60)
    pools = [await worker_pool(w.address, wait_s=10) if whole else None for w in stack.workers]
    rows = [kill.row(now) for kill in run.kills.kills]
    t = run.tally
    return {"streams": config.streams, "seconds": round(elapsed, 1), "kill_every_s": config.kill_every,
            "restart_delay_s": config.restart_delay, "kinds": list(config.kinds), "in_turn": config.in_turn,
            "seed": config.seed, "kills": rows, "by_kind": by_kind(rows),
            "broken_unattributed": run.broken_unattributed, "calls_refused_in_gateway_restarts": run.refused,
            "requests_done": t.done, "correct": t.correct, "lost": t.lost, "duplicated": t.duplicated,
            "reordered": t.reordered, "mismatched": t.mismatched, "cut": t.cut, "bad_prefix": t.bad_prefix,
            "errors": dict(t.errors), "tokens": t.tokens, "tokens_per_s": round(t.tokens / elapsed, 1),
            "workers_at_end": pools, "first_bad": t.first_bad, "bad_streams": run.bad}


def run_chaos(checkpoint: str, log_dir: str, config: ChaosConfig) -> dict:
    """The whole benchmark on `checkpoint`, services logging to `log_dir`: the result, with "ok" and what failed."""
    stack = ChaosStack(checkpoint, log_dir, [*WORKER_FLAGS, *config.worker_flags],
                       [*GATEWAY_FLAGS, *config.gateway_flags])
    try:
        result = asyncio.run(chaos(stack, config))
    finally:
        swept, left = stack.stop()
    result.update(cpu=cpu_description(), gateway_tokenizers=len(stack.tokenizers),
                  swept_at_stop=swept, left_running=left, log_dir=log_dir)
    result["failures"] = failures(result)
    result["ok"] = not result["failures"]
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16, help="concurrent client loops (default: 16)")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the streams run (default: 10)")
    parser.add_argument("--kill-every", type=float, default=15.0, help="seconds between kills (default: 15)")
    parser.add_argument("--restart-delay", type=float, default=1.0,
                        help="seconds before a killed worker, tokenizer or gateway is started again (default: 1)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"what may be killed (default: {','.join(KINDS)})")
    parser.add_argument("--in-turn", action="store_true", help="kill the --kinds in the order given, not at random")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kills, the requests and their lengths")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of each request, seconds")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="tokens per stream, eos ignored (default 0: 24 to 96, drawn from --seed)")
    parser.add_argument("--blame-within", type=float, default=5.0,
                        help="a stream failing this many seconds after a kill is blamed on it (default: 5)")
    parser.add_argument("--pause-window", type=float, default=5.0,
                        help="seconds after a kill over which each open stream's longest pause is taken (default: 5)")
    parser.add_argument("--max-kills", type=int, default=0, help="stop killing after this many (default: 0, no limit)")
    parser.add_argument("--model", help="checkpoint directory (default: the tiny demo checkpoint, built here)")
    parser.add_argument("--worker-flags", default="", help="more flags for the workers, in one string")
    parser.add_argument("--gateway-flags", default="", help="more flags for the gateway, in one string")
    args = parser.parse_args(argv)
    args.kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(args.kinds) - set(KINDS)
    if unknown or not args.kinds:
        parser.error(f"--kinds: choose among {', '.join(KINDS)}; got {args.kinds}")
    if args.streams < 1 or args.minutes <= 0 or args.kill_every <= 0 or args.restart_delay < 0 or args.max_tokens < 0:
        parser.error("--streams must be >= 1, --minutes and --kill-every > 0, --restart-delay and --max-tokens >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the stack on SIGTERM as on Ctrl-C
    config = ChaosConfig(args.streams, args.minutes, args.kill_every, args.restart_delay, args.kinds, args.in_turn,
                         args.seed, args.timeout, args.max_tokens or None, args.blame_within, args.pause_window,
                         shlex.split(args.worker_flags), shlex.split(args.gateway_flags), args.max_kills or None)
    print(f"CPU: {cpu_description()}", flush=True)
    log_dir = tempfile.mkdtemp(prefix="chaos-")
    print(f"service logs: {log_dir}", flush=True)
    result = run_chaos(args.model or build_demo_checkpoint(log_dir), log_dir, config)
    for line in result["failures"]:
        print(f"missed: {line}")
    print(json.dumps(result, ensure_ascii=False))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
