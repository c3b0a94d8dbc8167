"""Workers that serve only some kinds of request (--runner generate or pooling, a checkpoint without lm_head): the
fleet routes each kind only to workers that serve it, and says why when none does."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.fleet.router import Router
from gateway.fleet.worker_call import call_worker
from gateway.fleet.worker_stream import ResumePolicy
from gateway.fleet.workers import SERVING, Fleet, Worker
from rpcserver.errors import FailedPrecondition
from vllm_v0.worker.v1 import worker_pb2


def fleet_of(**workers) -> Fleet:
    """A fleet whose workers (by address) serve now and last reported these GetInfo fields; no calls are made."""
    fleet = Fleet([], grpc.aio.insecure_channel, 30.0, Router())
    for address, info in workers.items():
        worker = Worker(address, grpc.aio.insecure_channel(address), 30.0)
        worker.state = SERVING
        worker.info = worker_pb2.GetInfoResponse(model="m", **info)
        fleet.workers[address] = worker
    return fleet


def candidates(fleet: Fleet, kind: str) -> set[str]:
    chosen: list[str] = []
    while (worker := fleet.pick([1, 2, 3], exclude=tuple(chosen), kind=kind)) is not None:
        chosen.append(worker.address)
    return set(chosen)


def test_each_kind_goes_only_to_the_workers_that_serve_it():
    async def run():
        fleet = fleet_of(both={"runner": "auto"}, gen={"runner": "generate"}, pool={"runner": "pooling"},
                         headless={"runner": "auto", "embeddings_only": True}, older={})
        try:
            # A worker from before --runner reports "": it serves everything, as "auto".
            assert candidates(fleet, "generate") == {"both", "gen", "older"}
            assert candidates(fleet, "embed") == {"both", "pool", "headless", "older"}
            assert candidates(fleet, "score") == {"both", "pool", "older"}
            assert all(fleet.unserved(kind) is None for kind in ("generate", "embed", "score"))
        finally:
            await fleet.close()
    asyncio.run(run())


def test_a_kind_no_worker_serves_is_refused_with_the_reason():
    async def run():
        fleet = fleet_of(**{"w1:1": {"runner": "pooling"}, "w2:1": {"runner": "auto", "embeddings_only": True}})
        try:
            assert fleet.pick([1], kind="generate") is None
            assert fleet.unserved("generate") == ("no model worker serves generation: w1:1 runs --runner pooling, "
                                                  "w2:1 runs --runner auto on a checkpoint without lm_head")
            assert fleet.unserved("embed") is None and fleet.unserved("score") is None  # w1 serves both
            assert candidates(fleet, "score") == {"w1:1"}
        finally:
            await fleet.close()
    asyncio.run(run())


def test_no_refusal_while_a_worker_has_not_answered_yet():
    async def run():
        fleet = fleet_of(**{"g:1": {"runner": "generate"}})
        starting = Worker("p:1", grpc.aio.insecure_channel("p:1"), 30.0)  # e.g. a pooling worker still loading
        fleet.workers[starting.address] = starting
        try:
            assert fleet.unserved("embed") is None
            fleet.workers.pop(starting.address)
            assert fleet.unserved("embed") == "no model worker serves Embed: g:1 runs --runner generate"
        finally:
            await starting.channel.close()
            await fleet.close()
    asyncio.run(run())


def test_an_embed_call_to_a_fleet_that_only_generates_fails_at_once():
    async def run():
        fleet = fleet_of(**{"g:1": {"runner": "generate"}})
        try:
            with pytest.raises(FailedPrecondition, match="no model worker serves Embed: g:1 runs --runner generate"):
                await call_worker(fleet, ResumePolicy(max_resumes=3, wait_s=5.0), "Embed",
                                  worker_pb2.EmbedRequest(request_id="r"), [1, 2], timeout=5.0)
        finally:
            await fleet.close()
    asyncio.run(run())
