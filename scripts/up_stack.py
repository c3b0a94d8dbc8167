"""What scripts/up.sh checks around the stack it starts, as commands (python -m scripts.up_stack -h).

Before it starts anything: no other up.sh runs from this checkout and its ports are free, so a second
run fails at once and leaves the running stack, and its logs, alone. After: every port answers from
the process this run started for it. A health check alone cannot tell: the old stack answers it too.
The commands before the install use only the standard library.
"""
from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass


def claim(pid_file: str, pid: int) -> str | None:
    """Write `pid` to pid_file unless a live process already holds it; returns why not, or None."""
    try:
        with open(pid_file) as f:
            holder = int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        holder = 0
    if holder and holder != pid and is_alive(holder):
        return (f"scripts/up.sh is already running from this checkout (pid {holder}); its services and their "
                f"logs in .run/ are left as they are. Stop it first (Ctrl-C in its terminal, or kill {holder}).")
    with open(pid_file, "w") as f:
        f.write(f"{pid}\n")
    return None


def taken_ports(ports: dict[str, int], host: str = "127.0.0.1") -> list[str]:
    """One line for each port a service could not listen on, named by its variable ('VLLM_V0_HTTP_PORT')."""
    problems = []
    for name, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As gRPC and uvicorn bind: a port whose old connections linger in TIME_WAIT is free to them.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be listened on ({e.strerror})"
                problems.append(f"port {port} ({name}) {why}")
    return problems


def is_alive(pid: int) -> bool:
    """Whether the process exists and has not exited (an exited child not yet reaped is a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc here: kill(0) is all there is to go on


def listening_inodes(port: int) -> set[int] | None:
    """Socket inodes listening on TCP `port` in this network namespace; None where /proc/net is not there."""
    inodes, tables = set(), 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        tables += 1
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... inode
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(int(fields[9]))
    return inodes if tables else None


def serves(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a socket listening on `port`; None where that cannot be seen."""
    inodes = listening_inodes(port)
    if inodes is None:
        return None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    except PermissionError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed since the listing
        if target.startswith("socket:[") and int(target[len("socket:["):-1]) in inodes:
            return True
    return False


@dataclass
class Started:
    """A process up.sh started, and its ports: the first answers health checks."""
    name: str
    pid: int
    ports: list[int]


def wait_until_serving(started: list[Started], is_healthy: Callable[[int], bool], poll_s: float = 1.0,
                       sleep: Callable[[float], None] = time.sleep) -> str | None:
    """Wait until every process answers health checks on its port; returns why that failed, or None."""
    pending = list(started)
    while True:
        for service in started:
            if not is_alive(service.pid):
                return f"the {service.name} (pid {service.pid}) exited"
        pending = [service for service in pending if not is_healthy(service.ports[0])]
        if not pending:
            break
        sleep(poll_s)
    for service in started:
        for port in service.ports:
            if serves(service.pid, port) is False:
                return (f"port {port} answers, but not from the {service.name} this run started (pid {service.pid}):"
                        " another server holds it")
    return None


def grpc_healthy(port: int) -> bool:
    from rpcserver.healthcheck import check  # grpc: installed by then

    try:
        return check(f"localhost:{port}", "", 1.0) == "SERVING"
    except Exception:  # noqa: BLE001 - not up yet, whatever the reason: ask again
        return False


def has_chat_template(port: int) -> bool:
    """Whether the tokenizer on `port` renders chat for its checkpoint."""
    import grpc

    from vllm_v0.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

    with grpc.insecure_channel(f"localhost:{port}") as channel:
        info = tokenizer_pb2_grpc.TokenizerServiceStub(channel).GetInfo(tokenizer_pb2.GetInfoRequest(), timeout=10)
    return info.has_chat_template


def named(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def started_process(text: str) -> Started:
    """NAME=PID:PORT[,PORT...]"""
    name, value = named(text)
    pid, _, ports = value.partition(":")
    try:
        return Started(name, int(pid), [int(p) for p in ports.split(",")])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=PID:PORT[,PORT...], got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.up_stack", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("claim", help="record PID in PID_FILE; fails while another live process holds it")
    p.add_argument("pid_file")
    p.add_argument("pid", type=int)
    p = commands.add_parser("free", help="fail if a port is taken: VLLM_V0_GATEWAY_PORT=50051 ...")
    p.add_argument("ports", nargs="+", type=named)
    p = commands.add_parser("wait", help="wait until each process serves its ports: gateway=PID:50051,8000 ...")
    p.add_argument("started", nargs="+", type=started_process)
    p = commands.add_parser("chat", help="exit 0 if the tokenizer on PORT has a chat template, else 1")
    p.add_argument("port", type=int)
    args = parser.parse_args(argv)

    if args.command == "claim":
        problem = claim(args.pid_file, args.pid)
    elif args.command == "free":
        try:
            ports = {name: int(port) for name, port in args.ports}
        except ValueError:
            parser.error("ports must be numbers")
        taken = taken_ports(ports)
        problem = ("; ".join(taken) + ". Is another stack running (scripts/up.sh, docker compose)? Stop it, or set "
                   "these variables to free ports.") if taken else None
    elif args.command == "wait":
        problem = wait_until_serving(args.started, grpc_healthy)
    else:
        import grpc

        try:
            return 0 if has_chat_template(args.port) else 1
        except grpc.RpcError as e:
            print(f"cannot ask the tokenizer for its chat template ({e.code().name}): sending plain text",
                  file=sys.stderr)
            return 1
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
