"""What a client sees while a test stages a fault: open-loop calls with Envoy's deadline,
each call's outcome and latency kept with the time it was sent.

:class:`Probe` sends ShouldRateLimit at a fixed rate from a grpc.aio client (as heavy
as a real Python one), each with a 20 ms deadline (Envoy's filter timeout), whatever
the answers: a slow service does not slow the probe down, so a stall shows up as missed
deadlines, as it would behind Envoy. :func:`store_decides` asks whether the store is
deciding again: a fresh exact key must admit exactly its limit.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from ratelimit_service.cli.client import build_request

DEADLINE = 0.020
"""Envoy's ratelimit filter's default timeout."""
FAULTS_CONFIG = """\
domain: faults
descriptors:
  - key: load
    mode: exact
    failure_mode: open
    rate_limit: {unit: minute, requests_per_unit: 100000000}
  - key: fresh
    mode: exact
    failure_mode: open
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: sync
    mode: probabilistic
    rate_limit: {unit: minute, requests_per_unit: 100000000}
"""
"""The rules the fault tests run: ``load`` never denies while the store answers, so
every OVER_LIMIT is an error (a minute's window: hits admitted in an outage are owed to
the store for that long); ``sync`` keeps a probabilistic bucket syncing with the store;
``fresh`` (5 a minute per value) tells whether the store decides (a fresh value admits
exactly 5 of 8)."""
FRESH_LIMIT = 5


@dataclass
class Call:
    sent: float
    """Seconds since the probe started."""
    outcome: str
    """OK, OVER_LIMIT, or the gRPC status code's name."""
    latency: float


@dataclass
class Probe:
    port: int
    rate: float = 200.0
    keys: int = 100
    """Distinct ``load`` values, in turn."""
    calls: list[Call] = field(default_factory=list)
    cut: int = 0
    """Calls still out when the probe ended (not in :attr:`calls`): the service may
    have counted them. Complete once the probe's ``async with`` block is left."""
    _task: asyncio.Task[None] | None = None
    _start: float = 0.0

    def now(self) -> float:
        """Seconds since the probe started, on its clock."""
        return asyncio.get_running_loop().time() - self._start

    async def __aenter__(self) -> Probe:
        self._start = asyncio.get_running_loop().time()
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with _suppress_cancel():
            await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        requests = [build_request("faults", [f"load=v{i}"], 0) for i in range(self.keys)]
        cycle = itertools.cycle(requests)
        pending: set[asyncio.Task[None]] = set()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            try:
                for n in itertools.count():
                    due = self._start + n / self.rate
                    if due > loop.time():
                        await asyncio.sleep(due - loop.time())
                    task = asyncio.ensure_future(self._one(stub, next(cycle)))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
            finally:
                # Wait for the cancelled calls to end (several turns of the loop in
                # grpc.aio), so that each is in `cut` when the probe's block is left:
                # the test reads it at once, and a call it missed counts as unseen
                # although the service may have admitted it.
                out = list(pending)
                for task in out:
                    task.cancel()
                await asyncio.gather(*out, return_exceptions=True)

    async def _one(self, stub: rls_pb2_grpc.RateLimitServiceStub, request: object) -> None:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            response = await stub.ShouldRateLimit(request, timeout=DEADLINE)
        except grpc.aio.AioRpcError as exc:
            outcome = exc.code().name
        except asyncio.CancelledError:
            self.cut += 1
            raise
        else:
            outcome = rls_pb2.RateLimitResponse.Code.Name(response.overall_code)
        self.calls.append(Call(sent - self._start, outcome, loop.time() - sent))

    def between(self, start: float, end: float = float("inf")) -> list[Call]:
        return [c for c in self.calls if start <= c.sent < end]

    @staticmethod
    def outcomes(calls: Sequence[Call]) -> Counter[str]:
        return Counter(c.outcome for c in calls)


class _suppress_cancel:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> bool:
        return kind is asyncio.CancelledError


_fresh = itertools.count()


async def touch_probabilistic(port: int) -> None:
    """One call on the probabilistic rule: its bucket then syncs with the store every
    interval (``ratelimit_sync_rounds_total`` / ``ratelimit_sync_errors_total``)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        await stub.ShouldRateLimit(build_request("faults", ["sync=s"], 0), timeout=1.0)


async def store_decides(port: int, values: int = 1) -> bool:
    """Whether the store decides exact rules now: each of ``values`` values never used
    before admits exactly its limit (5) of 8 calls (failure_mode open would admit all
    8). Several values reach several nodes of a Cluster."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        for _ in range(values):
            if not await fresh_decided(stub, f"f{next(_fresh)}", FRESH_LIMIT + 3):
                return False
    return True


async def fresh_decided(
    stub: rls_pb2_grpc.RateLimitServiceStub, value: str, calls: int = FRESH_LIMIT + 1
) -> bool:
    """Whether the store decides the ``fresh`` rule's ``value`` (never used before):
    exactly its limit (5) of ``calls`` calls admitted (failure_mode open admits all)."""
    request = build_request("faults", [f"fresh={value}"], 0)
    admitted = 0
    for _ in range(calls):
        response = await stub.ShouldRateLimit(request, timeout=1.0)
        admitted += response.overall_code == rls_pb2.RateLimitResponse.OK
    return admitted == FRESH_LIMIT


def fresh_key(value: str, prefix: str = "rl:") -> str:
    """The Redis key of the ``fresh`` rule's ``value`` (the store's exact key: prefix,
    window, the domain's and descriptor's names, the window again; see
    core.matching.bucket_key)."""
    return f"{prefix}e:60:faults\x1ffresh\x1e{value}\x1f60"
