"""What the gateway's tokenizers and workers share: each one's health, and the set that --*-addr targets stand for."""
from __future__ import annotations

import abc
import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

SERVING, NOT_SERVING, UNREACHABLE = "serving", "not_serving", "unreachable"
DNS_PREFIX = "dns:///"


def parse_targets(values: list[str] | str) -> list[str]:
    """--tokenizer-addr or --worker-addr values (repeatable, each comma-separated) as one list without repeats."""
    values = [values] if isinstance(values, str) else values
    targets: list[str] = []
    for value in values:
        for target in value.split(","):
            if (target := target.strip()) and target not in targets:
                targets.append(target)
    return targets


async def resolve(target: str) -> list[str]:
    """The addresses a target stands for: a dns:/// entry every address its name has now, else itself."""
    if not target.startswith(DNS_PREFIX):
        return [target]
    host, _, port = target[len(DNS_PREFIX):].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a dns:/// worker address needs host:port, got {target!r}")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = {(f"[{ip}]" if family == socket.AF_INET6 else ip) + f":{port}"
                 for family, _, _, _, (ip, *_) in infos}
    return sorted(addresses)


async def wanted_addresses(targets: list[str], known, unresolved: set[str]) -> list[str]:
    """Every address the targets stand for now, without repeats. A dns:/// target whose lookup fails keeps
    the `known` addresses until it resolves again; `unresolved` holds such targets, so each failure and
    each recovery is logged once."""
    wanted: list[str] = []
    for target in targets:
        try:
            wanted.extend(a for a in await resolve(target) if a not in wanted)
        except OSError as e:  # keep what it stood for until the name resolves again
            if target not in unresolved:
                log.warning("cannot resolve %s (%s); keeping its last addresses until it resolves", target, e)
                unresolved.add(target)
            wanted.extend(a for a in known if a not in wanted and target.startswith(DNS_PREFIX))
            continue
        if target in unresolved:
            log.info("%s resolves again", target)
            unresolved.discard(target)
    return wanted


class Member:
    """One downstream service: its channel, and its health as grpc.health.v1 Check finds it every interval;
    `on_change` is called whenever its state changes."""

    kind = "member"  # what its log lines call it
    log = log  # a subclass logs as its own module

    def __init__(self, address: str, channel: grpc.aio.Channel, interval: float,
                 on_change: Callable[[], None] = lambda: None):
        self.address = address
        self.channel = channel
        self._health = health_pb2_grpc.HealthStub(channel)
        self.interval = interval
        self.on_change = on_change
        self.state = UNREACHABLE
        self._watch: asyncio.Task | None = None

    @property
    def serving(self) -> bool:
        return self.state == SERVING

    def start(self) -> None:
        self._watch = asyncio.create_task(self._watch_health(), name=f"watch {self.address}")

    async def close(self) -> None:
        tasks = [t for t in self._tasks() if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.channel.close()

    def _tasks(self) -> list[asyncio.Task | None]:
        """The tasks `close` ends before it closes the channel."""
        return [self._watch]

    async def _check(self) -> str:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return UNREACHABLE
        return SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else NOT_SERVING

    def _set_state(self, state: str) -> None:
        if state != self.state:
            (self.log.info if state == SERVING else self.log.warning)(
                "%s %s: %s -> %s", self.kind, self.address, self.state, state)
            self.state = state
            self.on_change()

    async def _watch_health(self) -> None:
        while True:
            self._set_state(await self._check())
            await asyncio.sleep(self.interval)


M = TypeVar("M", bound=Member)


class MemberSet(abc.ABC, Generic[M]):
    """The members the targets stand for, kept in step with DNS: a dns:/// target is looked up again every
    interval, a member joins for each new address, and one whose address is gone retires."""

    kind = "member"  # what its log lines and task names call a member
    log = log  # a subclass logs as its own module

    def __init__(self, targets: list[str], open_channel: Callable[[str], grpc.aio.Channel], interval: float):
        self.targets = targets
        self.open_channel = open_channel
        self.interval = interval
        self.changed = asyncio.Event()  # set whenever a member joins, leaves or changes state
        self._resolver: asyncio.Task | None = None
        # The event loop holds tasks only weakly: without this set a retiring member's task could be
        # collected mid-wait, leaving its channel open for good.
        self._retiring: set[asyncio.Task] = set()
        # Targets whose last lookup failed: said once, not every interval (a Kubernetes headless Service
        # has no address at all until its first pod is ready, which can take many minutes).
        self._unresolved: set[str] = set()

    @property
    @abc.abstractmethod
    def members(self) -> dict[str, M]:
        """Every member by address (a subclass holds them under its own name)."""

    @abc.abstractmethod
    def _join(self, address: str) -> M:
        """A new member at `address`, its callbacks wired to this set; not started yet."""

    @abc.abstractmethod
    async def _wait_to_retire(self, member: M) -> None:
        """Until a removed member may be closed."""

    async def start(self) -> None:
        await self._resolve()
        if any(t.startswith(DNS_PREFIX) for t in self.targets):
            self._resolver = asyncio.create_task(self._resolve_every_interval(), name=f"resolve {self.kind}s")

    def serving(self) -> list[M]:
        return [m for m in self.members.values() if m.serving]

    async def close(self) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
        for task in self._retiring:
            task.cancel()  # closes the member at once rather than after its wait
        await asyncio.gather(*(m.close() for m in self.members.values()))
        await asyncio.gather(*self._retiring, return_exceptions=True)
        self.members.clear()

    def _changed(self) -> None:
        self.changed.set()

    async def _resolve(self) -> None:
        wanted = await wanted_addresses(self.targets, self.members, self._unresolved)
        for address in [a for a in self.members if a not in wanted]:
            self.log.info("%s %s: no longer in %s; removing it", self.kind, address, ", ".join(self.targets))
            task = asyncio.create_task(self._retire(self.members.pop(address)), name=f"retire {address}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
            self._changed()
        for address in wanted:
            if address not in self.members:
                member = self._join(address)
                self.members[address] = member
                member.start()
                self._changed()

    async def _retire(self, member: M) -> None:
        """Close a removed member once its wait ends (or the set closes)."""
        try:
            await self._wait_to_retire(member)
        finally:
            await member.close()

    async def _resolve_every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._resolve()
