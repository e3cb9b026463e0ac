"""The native front door's turns (server/native_grpc.py, TURN_SECONDS): a turn of the
event loop starts calls for a bounded time; the calls read past it wait for the next
turn, their connection reads no more meanwhile, and every call still gets its own
answer. A call held back, or left in the kernel, is known to be that much older
(``waited``), so that too little time left is said at once.

In process, on a real socket, with grpc.aio as the client; the route's ``start`` is the
test's: it records the loop's turn and the ``waited`` each call was started with."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest

from ratelimit_service.server.native_grpc import (
    TURN_SECONDS,
    BackendSocket,
    NativeGrpcServer,
    Route,
)

PATH = "/test.Turns/Call"


@dataclass
class Ticker:
    """Counts the event loop's turns: one callback per turn, re-scheduled each time."""

    turns: int = 0
    running: bool = True

    def tick(self) -> None:
        if self.running:
            self.turns += 1
            asyncio.get_running_loop().call_soon(self.tick)


@dataclass
class Recorder:
    ticker: Ticker
    spend: float
    """Seconds of CPU each call takes to start (a busy wait: the loop is held)."""
    started: list[tuple[bytes, int, float]] = field(default_factory=list)
    """(message, turn, waited) per call, in the order started."""

    def start(self, message: bytes, deadline: float | None, waited: float) -> bytes:
        self.started.append((message, self.ticker.turns, waited))
        until = time.perf_counter() + self.spend
        while time.perf_counter() < until:
            pass
        return b"answer:" + message


@dataclass
class Served:
    port: int
    recorder: Recorder


@contextlib.asynccontextmanager
async def serve(turn_seconds: float, spend: float) -> AsyncIterator[Served]:
    ticker = Ticker()
    recorder = Recorder(ticker, spend)
    server = NativeGrpcServer(
        {PATH: Route(lambda message: None, start=recorder.start)},
        BackendSocket("unix:/nonexistent", "/nonexistent"),  # nothing is spliced here
        max_request_bytes=1 << 20,
        turn_seconds=turn_seconds,
    )
    port = await server.start("127.0.0.1:0")
    ticker.tick()
    try:
        yield Served(port, recorder)
    finally:
        ticker.running = False
        await server.stop(0.5)


@pytest.fixture
async def one_call_a_turn() -> AsyncIterator[Served]:
    async with serve(turn_seconds=0.0, spend=0.001) as served:
        yield served


@pytest.fixture
async def default_turns() -> AsyncIterator[Served]:
    async with serve(turn_seconds=TURN_SECONDS, spend=0.0) as served:
        yield served


async def call_all(port: int, count: int) -> list[bytes]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(PATH)
        return list(await asyncio.gather(*(call(b"%d" % n, timeout=10) for n in range(count))))


async def test_calls_past_the_turn_wait_for_the_next_and_each_gets_its_answer(
    one_call_a_turn: Served,
) -> None:
    answers = await call_all(one_call_a_turn.port, 40)
    assert answers == [b"answer:%d" % n for n in range(40)]
    started = one_call_a_turn.recorder.started
    assert sorted(message for message, _, _ in started) == sorted(b"%d" % n for n in range(40))
    turns = [turn for _, turn, _ in started]
    assert len(set(turns)) == 40  # a turn of 0 s starts one call, the others wait
    assert turns == sorted(turns)


async def test_a_call_held_back_is_known_to_be_older(one_call_a_turn: Served) -> None:
    await call_all(one_call_a_turn.port, 40)
    waited = [w for _, _, w in one_call_a_turn.recorder.started]
    # 40 calls sent together, 1 ms of CPU each to start, one a turn: the last started
    # waited behind 39 others, held back here or in the kernel.
    assert waited[-1] >= 0.025
    assert max(waited[:5]) < waited[-1]


async def test_an_unloaded_turn_starts_every_call_it_reads(default_turns: Served) -> None:
    answers = await call_all(default_turns.port, 40)
    assert answers == [b"answer:%d" % n for n in range(40)]
    turns = {turn for _, turn, _ in default_turns.recorder.started}
    assert len(turns) < 20  # calls that come together are started together


async def test_a_call_held_past_its_deadline_is_not_started(one_call_a_turn: Served) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{one_call_a_turn.port}") as channel:
        call = channel.unary_unary(PATH)
        outcomes = await asyncio.gather(
            *(call(b"%d" % n, timeout=0.015) for n in range(40)), return_exceptions=True
        )
    answered = [o for o in outcomes if isinstance(o, bytes)]
    failed = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(answered) + len(failed) == 40
    assert {e.code() for e in failed} == {grpc.StatusCode.DEADLINE_EXCEEDED}
    started = one_call_a_turn.recorder.started
    # 1 ms a call, one a turn: the calls held 15 ms were answered without being started.
    assert 0 < len(started) < 40
    assert all(waited < 0.015 for _, _, waited in started)
