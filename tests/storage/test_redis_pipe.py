"""The pipelined request-path connection against real redis-servers: database
selection, Unix sockets, a lost or stuck connection, and deadlines in the queue."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from ratelimit_harness.redis import spawn_redis
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.exact import ExactHit, ExactResult
from ratelimit_service.storage import exact_batcher
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.redis_store import RedisStore

pytestmark = [
    pytest.mark.serial,  # timing: run alone, after the parallel part
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server"),
]

HIT = [ExactHit("k", 5, 60, 1)]


async def hit_once_recovered(store: RedisStore) -> list[ExactResult]:
    """A hit, retried while the circuit breaker still holds calls back (its backoff
    lets a trial call through within a second)."""
    return await eventually_async(
        lambda: store.hit(HIT, True),
        timeout=5,
        what="the store recovered",
        ignore=(StoreUnavailable,),
    )


async def test_selects_the_database_in_the_url(redis_server) -> None:
    store = RedisStore(redis_server.url.rsplit("/", 1)[0] + "/3", request_timeout=1)
    try:
        assert (await store.hit(HIT, True))[0].admitted
        assert store.redis.pipe is not None and store.redis.pipe.connects == 1
        for db, expected in ((0, 0), (3, 1)):
            raw = aioredis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + f"/{db}")
            assert await raw.exists(store._exact_key("k", 60)) == expected
            await raw.aclose()
    finally:
        await store.close()


@pytest.mark.slow  # starts a process
async def test_unix_socket(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    port = 0  # no TCP listener at all
    process = spawn_redis(port, tmp_path / "unix", "--unixsocket", str(sock))
    try:
        await eventually_async(sock.exists, timeout=5, what="redis-server's socket")
        store = RedisStore(f"unix://{sock}?db=0", request_timeout=1)
        results = [(await store.hit(HIT, True))[0].remaining for _ in range(3)]
        assert results == [4, 3, 2]
        await store.close()
    finally:
        process.kill()
        process.wait()


async def test_waiters_hear_a_lost_connection_and_the_next_call_reconnects(
    redis_server,
) -> None:
    store = RedisStore(redis_server.url, request_timeout=2.0)
    try:
        await store.hit(HIT, True)
        redis_server.pause()
        pending = [asyncio.ensure_future(store.hit(HIT, True)) for _ in range(3)]
        await eventually_async(lambda: store.redis.calls >= 2, timeout=5, what="the hits sent")
        started = time.monotonic()
        redis_server.stop()  # killed while paused: the connection is reset
        outcomes = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(o, StoreUnavailable) for o in outcomes)
        assert time.monotonic() - started < 1.0  # told at once, not at the 2 s deadline
        redis_server.start()
        result = await hit_once_recovered(store)
        assert result[0].before == 0  # a fresh server
        assert store.redis.pipe is not None and store.redis.pipe.connects == 2
    finally:
        await store.close()


async def test_a_silent_connection_is_dropped_and_opens_the_breaker(redis_server) -> None:
    """A call given up at its deadline is no evidence; no byte for ``silence`` with
    calls outstanding is: the connection is dropped and the breaker opens at once. (No
    gap between calls: each is written when it is made, so the silence a request finds
    is the time since the one before it was made.)"""
    store = RedisStore(redis_server.url, request_timeout=0.1, silence=0.25, batch_hold=0.0)
    try:
        await store.hit(HIT, True)
        redis_server.pause()  # a silent peer: no reset, no reply
        with pytest.raises(StoreUnavailable, match="no answer"):
            await store.hit(HIT, True)
        assert not store.redis.breaker.open and store.healthy()  # slow is not down
        assert store.metrics().figures["silences"] == 0
        with pytest.raises(StoreUnavailable, match="silent for longer"):
            await store.hit(HIT, True)  # 0.1 s of silence: it would wait in vain
        assert store.metrics().figures["exact_hopeless"] == 1
        await asyncio.sleep(0.2)  # the subject: 0.3 s of silence in all
        with pytest.raises(StoreUnavailable, match="circuit open"):
            await store.hit(HIT, True)  # its look finds 0.3 s: dropped, the breaker open
        assert store.metrics().figures["silences"] == 1
        assert store.redis.breaker.open and not store.healthy()
        redis_server.resume()
        result = await hit_once_recovered(store)
        assert store.redis.pipe is not None and store.redis.pipe.connects == 2  # dropped, reopened
        # The hit sent while it was paused waits in its socket and lands when it
        # resumes, though its caller gave up; nothing is doubled.
        assert result[0].before in (1, 2, 3)
    finally:
        await store.close()


async def test_a_queued_request_waits_until_its_own_deadline_not_longer(
    redis_server, monkeypatch
) -> None:
    """A request's deadline runs from its submission: time queued behind a slow call
    counts, since the caller cannot use an answer after it."""
    monkeypatch.setattr(exact_batcher, "MAX_IN_FLIGHT", 1)  # the second request queues
    store = RedisStore(redis_server.url, request_timeout=0.2)
    try:
        await store.hit(HIT, True)
        redis_server.pause()
        first = asyncio.ensure_future(store.hit(HIT, True))  # in flight, never answered
        await asyncio.sleep(0.1)  # the subject: 0.1 s queued counts against its deadline
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.hit(HIT, True)  # queued behind it for 0.1 s, then sent
        waited = time.monotonic() - started
        assert 0.18 < waited < 0.3  # its own 0.2 s, queued all along
        with pytest.raises(StoreUnavailable):
            await first
    finally:
        redis_server.resume()
        await store.close()


async def test_calls_in_flight_each_fail_at_their_own_deadline(redis_server) -> None:
    """One timer serves every call in flight: each must still fail at its own
    deadline, the older one first, not when the newest one's runs out."""
    store = RedisStore(redis_server.url, request_timeout=0.3)
    loop = asyncio.get_running_loop()
    failed_at: dict[str, float] = {}

    async def timed(name: str) -> None:
        with pytest.raises(StoreUnavailable, match="no answer"):
            await store.hit(HIT, True)
        failed_at[name] = loop.time()

    try:
        await store.hit(HIT, True)  # connected
        redis_server.pause()
        started = loop.time()
        older = asyncio.ensure_future(timed("older"))
        await asyncio.sleep(0.15)  # the subject: two deadlines 0.15 s apart
        newer = asyncio.ensure_future(timed("newer"))
        await asyncio.gather(older, newer)
        assert 0.25 < failed_at["older"] - started < 0.4
        assert 0.4 < failed_at["newer"] - started < 0.55
    finally:
        redis_server.resume()
        await store.close()


async def test_an_answered_call_s_deadline_does_not_let_a_queued_call_past_the_cap(
    redis_server, monkeypatch
) -> None:
    """The deadline timer stays armed after its call is answered; when it fires with
    nothing expired, the queued batch must keep waiting for a free slot."""
    monkeypatch.setattr(exact_batcher, "MAX_IN_FLIGHT", 1)
    store = RedisStore(redis_server.url, request_timeout=0.3)
    try:
        await store.hit(HIT, True)  # answered at once; its timer fires 0.3 s from now
        await asyncio.sleep(0.1)  # the subject: the timer's due time, 0.2 s ahead now
        redis_server.pause()
        in_flight = asyncio.ensure_future(store.hit(HIT, True))  # stuck until 0.4 s
        queued = asyncio.ensure_future(store.hit(HIT, True))  # waits for the slot
        await asyncio.sleep(0.25)  # past the first call's deadline, not the second's
        assert store.redis.calls == 2  # the queued batch has not gone out
        for pending in (in_flight, queued):
            with pytest.raises(StoreUnavailable):
                await pending
    finally:
        redis_server.resume()
        await store.close()


async def test_calls_expiring_together_all_count_as_timeouts(redis_server) -> None:
    store = RedisStore(redis_server.url, request_timeout=0.2, silence=10)
    try:
        await store.hit(HIT, True)
        redis_server.pause()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, time.sleep, 3.3)  # block the loop past every deadline
        calls = [asyncio.ensure_future(store.hit(HIT, True)) for _ in range(3)]
        for call in calls:
            with pytest.raises(StoreUnavailable, match="no answer"):
                await call
        assert store.metrics().figures["timeouts"] == 3
    finally:
        redis_server.resume()
        await store.close()


async def test_a_reply_that_came_while_the_loop_was_blocked_is_used(redis_server) -> None:
    """The process is not running (here: its loop blocked) from just after the call
    is written until well past the deadline; Redis answered meanwhile. The reply is on
    the socket, and it is used, whichever runs first on waking: the deadline timer
    (uvloop runs due timers before polling for I/O) or the read."""
    store = RedisStore(redis_server.url, request_timeout=0.05, silence=10, batch_hold=0.0)
    try:
        await store.hit(HIT, True)  # connected
        for _ in range(5):
            call = asyncio.ensure_future(store.hit(HIT, True))
            await asyncio.sleep(0)  # the call is written
            time.sleep(0.2)  # the subject: the loop blocked for four times the deadline
            results = await call
            assert results[0].admitted is not None
        stats = store.metrics().figures
        assert stats["timeouts"] == 0 and stats["exact_given_up"] == 0
        assert store.healthy() and not store.redis.breaker.open
        assert store.redis.reply_time.count == 6
        assert store.redis.reply_time.sum >= 5 * 0.2  # the time as the process saw it
    finally:
        await store.close()
