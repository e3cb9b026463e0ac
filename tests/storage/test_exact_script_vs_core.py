"""The Lua script (real redis-server) decides exactly as the Python core does.

exact_window.lua re-implements core/exact.py and core/window.py for Redis. Random
traffic (shared keys, repeated keys within a request, every role, costs, check-only
requests, requests denied already, hits of 0) goes to both. The first test sends it
through the store, batched several requests to a call, on hour-long windows (nothing
leaves them while it runs).
The second runs the script on a clock the test sets, so slices expire between calls,
and compares reset times too, and the bookkeeping fields after every call. The third
holds the script's denial rule to core/exact.py's ``denies`` over every combination of
roles and verdicts, and the fourth its counting rule to ``counts`` over every role,
verdict, cost or not, and commit. Replies are read by the store's own decoder (exact_reply).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time

import pytest
import redis.asyncio as aioredis

from ratelimit_harness.fixtures import window_slices
from ratelimit_harness.redis import script_on_test_clock, set_test_clock
from ratelimit_service.core.exact import (
    CHECK,
    DECIDE,
    DENIED,
    ExactHit,
    ExactResult,
    HitRole,
    counts,
    denies,
    evaluate,
)
from ratelimit_service.core.window import SlidingWindow
from ratelimit_service.storage import exact_batcher
from ratelimit_service.storage.embedded import EmbeddedStore
from ratelimit_service.storage.redis_store import RedisStore
from ratelimit_service.storage.script_calls import (
    add_exact_request,
    exact_batch_args,
    exact_reply,
    hit_args,
)

WINDOW = 3600
ROLES = [HitRole.ENFORCE, HitRole.ENFORCE, HitRole.SHADOW, HitRole.QUOTA]


def random_commit(rng: random.Random) -> int:
    """Mostly decided here; some check-only calls and some requests denied already."""
    return rng.choices([DECIDE, CHECK, DENIED], [8, 1, 1])[0]


def random_request(rng: random.Random) -> tuple[list[ExactHit], int]:
    hits = []
    for _ in range(rng.randint(1, 4)):
        amount = rng.choice([0, 1, 1, 1, 2, 3, 7])
        hits.append(
            ExactHit(
                key=rng.choice("abcd"),
                limit=rng.randint(3, 15),
                window_seconds=WINDOW,
                hits=amount,
                role=rng.choice(ROLES),
                cost=amount >= 1 and rng.random() < 0.3,
            )
        )
    return hits, random_commit(rng)


def outcomes(results: list[ExactResult]) -> list[tuple[bool, int, int]]:
    return [(r.admitted, r.before, r.remaining) for r in results]


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_script_agrees_with_core(redis_server, monkeypatch, seed: int) -> None:
    # One call in flight: the requests of a group queue behind it and share calls.
    monkeypatch.setattr(exact_batcher, "MAX_IN_FLIGHT", 1)
    rng = random.Random(seed)
    redis = RedisStore(redis_server.url, request_timeout=2)
    model = EmbeddedStore()
    try:
        compared = denied = costs_over = 0
        for _ in range(40):
            group = [random_request(rng) for _ in range(rng.randint(1, 8))]
            # Keys of one seed only: a rerun of the module on the same server starts afresh.
            group = [
                ([ExactHit(f"{seed}:{h.key}", h.limit, h.window_seconds, h.hits, h.role, h.cost)
                  for h in hits], commit)
                for hits, commit in group
            ]  # fmt: skip
            got = await asyncio.gather(*(redis.hit(hits, commit) for hits, commit in group))
            for (hits, commit), results in zip(group, got, strict=True):
                want = await model.hit(hits, commit)
                assert outcomes(results) == outcomes(want), (hits, commit)
                for result in results:
                    assert 0 <= result.reset_after <= WINDOW
                compared += len(results)
                denied += sum(not r.admitted for r in results)
                pairs = zip(hits, results, strict=True)
                costs_over += sum(h.cost and not r.admitted for h, r in pairs)
        assert (
            redis.metrics().figures["exact_batches"]
            < redis.metrics().figures["exact_batched_requests"]
        )
        assert compared > 300 and denied > 50  # the traffic did reach the limits
        assert costs_over > 10  # denied costs were counted (or the counts would differ)
    finally:
        await redis.close()


async def check_bookkeeping(
    client: aioredis.Redis, now_us: int, slices: int, set_at: dict[bytes, float] | None = None
) -> None:
    """n, o and c agree with the slices; every key has an expiry past its newest slice.

    The script sets a key's expiry from the test clock, but Redis counts it down in real
    time: ``set_at`` holds when (time.monotonic) each key was last written, and the real
    time since then is allowed for (on a busy machine it is more than the 1 ms kept)."""
    for key in await client.keys("w:*"):
        fields = await client.hgetall(key)
        live = window_slices(fields)
        assert live and all(hits > 0 for hits in live.values()), (key, fields)
        window_us = int(key.split(b":")[1]) * 1_000_000
        width = window_us / slices
        leaves_at = (max(live) + slices + 1) * width
        since = (set_at or {}).get(key)
        ran_us = (time.monotonic() - since) * 1e6 if since is not None else 0.0
        assert await client.pttl(key) * 1000 >= leaves_at - now_us - 1000 - ran_us, key


def window(
    models: dict[tuple[str, int], SlidingWindow], hit: ExactHit, slices: int
) -> SlidingWindow:
    return models.setdefault(
        (hit.key, hit.window_seconds), SlidingWindow(hit.window_seconds, slices)
    )


@pytest.mark.parametrize("slices", [1, 3, 60])
async def test_script_agrees_with_core_as_slices_expire(redis_server, slices: int) -> None:
    rng = random.Random(slices)
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("exact_window.lua")
    models: dict[tuple[str, int], SlidingWindow] = {}
    now_us = 1_700_000_000_000_000 + rng.randrange(10**9)
    seen = {"denied": 0, "expired": 0}
    set_at: dict[bytes, float] = {}
    try:
        for _ in range(150):
            step = rng.choice([0, rng.randrange(200_000), rng.randrange(3_000_000)])
            now_us += rng.choice([step, step, rng.randrange(8_000_000)])
            await set_test_clock(client, now_us)
            requests = [
                ([ExactHit(rng.choice("ab"), rng.randint(0, 8), rng.choice([1, 2, 3]),
                           amount := rng.choice([0, 1, 1, 2, 3, 5, 9]), rng.choice(ROLES),
                           amount >= 1 and rng.random() < 0.3)
                  for _ in range(rng.randint(1, 4))], random_commit(rng))
                for _ in range(rng.randint(1, 5))
            ]  # fmt: skip
            keys: list[str] = []
            args = exact_batch_args(slices)
            for hits, commit in requests:
                keys += [f"w:{hit.window_seconds}:{hit.key}" for hit in hits]
                add_exact_request(args, commit, hit_args(hits))
            live_before = sum(m.total for m in models.values())
            raw = await client.eval(source, len(keys), *keys, *args)
            set_at.update((key.encode(), time.monotonic()) for key in keys)
            got = iter(exact_reply(raw, 0, len(keys)))
            for hits, commit in requests:
                windows = [window(models, hit, slices) for hit in hits]
                wants = evaluate(hits, windows, now_us / 1e6, commit)
                for hit, want in zip(hits, wants, strict=True):
                    result = next(got)
                    assert outcomes([result]) == outcomes([want]), (hits, commit)
                    assert math.isclose(result.reset_after, want.reset_after, abs_tol=3e-6)
                    assert 0 <= result.reset_after <= hit.window_seconds
                    seen["denied"] += not want.admitted
            seen["expired"] += live_before > sum(m.count(now_us / 1e6) for m in models.values())
            await check_bookkeeping(client, now_us, slices, set_at)
        assert seen["denied"] > 50 and seen["expired"] > 10  # both paths were exercised
    finally:
        await client.aclose()


async def test_a_reset_is_never_longer_than_the_window(redis_server) -> None:
    """A one-minute rule hit 0.08 s into a slice: its slice leaves the window 60.92 s
    later; the script says 60 s, admitted or denied, as core/exact.py does, and the
    wait shrinks with the clock from there."""
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("exact_window.lua")
    start_us = 1_700_000_000_080_000  # 0.08 s into a one-second slice
    key = "w:60:reset"

    async def call(at_us: int, hits: int) -> ExactResult:
        await set_test_clock(client, at_us)
        args = exact_batch_args(60)
        add_exact_request(args, True, hit_args([ExactHit("reset", 2, 60, hits)]))
        (result,) = exact_reply(await client.eval(source, 1, key, *args), 0, 1)
        return result

    try:
        await client.delete(key)
        first, second, denied = [await call(start_us, 1) for _ in range(3)]
        assert [r.admitted for r in (first, second, denied)] == [True, True, False]
        assert (first.reset_after, second.reset_after, denied.reset_after) == (60.0, 60.0, 60.0)
        later = await call(start_us + 30_250_000, 0)  # a check 30.25 s later
        assert not later.admitted
        assert math.isclose(later.reset_after, 60.92 - 30.25, abs_tol=1e-6)
    finally:
        await client.aclose()


async def test_bookkeeping_survives_a_clock_that_steps_back(redis_server) -> None:
    """Redis's clock going back (a failover to a host that runs behind) puts a hit in a
    slice older than o; a later call that reads the slices deletes it as expired. The
    running total must lose it too, even when the same call adds hits."""
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("exact_window.lua")
    start = 1_700_000_000

    async def call(at: int, *requests: tuple[int, int, int]) -> None:
        """Each request: (limit, hits, commit), one descriptor on key w:60:k."""
        await set_test_clock(client, at * 10**6)
        args = exact_batch_args(60)
        for limit, hits, commit in requests:
            add_exact_request(args, bool(commit), hit_args([ExactHit("k", limit, 60, hits)]))
        await client.eval(source, len(requests), *["w:60:k"] * len(requests), *args)

    try:
        await call(start, (10, 2, 1))
        await call(start - 3, (10, 1, 1))  # lands before o: counted in n, not in o
        await call(start + 58, (3, 0, 1), (10, 1, 1))  # a denied check reads the slices
        await check_bookkeeping(client, (start + 58) * 10**6, 60)
    finally:
        await client.aclose()


async def test_the_scripts_denial_rule_is_denies(redis_server) -> None:
    """Every request of one to three descriptors, each enforce, shadow or quota and each
    fitting or not: the script consumes exactly when core/exact.py's ``denies`` lets
    the request through (a fitting hit shows it by the window it consumed)."""
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("exact_window.lua")
    await set_test_clock(client, 1_700_000_000_000_000)
    cases = [
        case
        for n in (1, 2, 3)
        for case in itertools.product(itertools.product(HitRole, (True, False)), repeat=n)
    ]
    try:
        for number, case in enumerate(cases):
            # A fitting descriptor has room for its hit; one over has a limit of 0.
            hits = [ExactHit(f"rule:{number}:{i}", int(fits), 60, 1, role)
                    for i, (role, fits) in enumerate(case)]  # fmt: skip
            args = exact_batch_args(60)
            add_exact_request(args, True, hit_args(hits))
            keys = [f"w:60:{hit.key}" for hit in hits]
            results = exact_reply(await client.eval(source, len(keys), *keys, *args), 0, len(hits))
            assert [r.admitted for r in results] == [fits for _, fits in case]
            enforce_over = any(role is HitRole.ENFORCE and not fits for role, fits in case)
            quota = [fits for role, fits in case if role is HitRole.QUOTA]
            let_through = not denies(enforce_over, bool(quota), any(quota))
            pairs = zip(results, case, strict=True)
            consumed = [result.remaining == 0 for result, (_, fits) in pairs if fits]
            assert consumed == [let_through] * len(consumed), case
        assert len(cases) == 6 + 36 + 216
    finally:
        await client.aclose()


async def test_fields_of_another_layout_are_dropped_at_the_recount(redis_server) -> None:
    """A window written with other bookkeeping fields (n, o and c, an earlier layout)
    has no sum: the script counts its slices, keeps the hits, and drops those fields."""
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("exact_window.lua")
    now_us = 1_700_000_000_000_000
    slice_index = now_us // 1_000_000  # 60 s in 60 slices: one a second
    await client.delete("w:60:old")
    await client.hset("w:60:old", mapping={str(slice_index): 3, "n": 3, "o": slice_index,
                                           "c": slice_index})  # fmt: skip
    try:
        await set_test_clock(client, now_us)
        args = exact_batch_args(60)
        add_exact_request(args, True, hit_args([ExactHit("old", 10, 60, 2)]))
        (result,) = exact_reply(await client.eval(source, 1, "w:60:old", *args), 0, 1)
        assert (result.admitted, result.before, result.remaining) == (True, 3, 5)
        assert window_slices(await client.hgetall("w:60:old")) == {slice_index: 5}
    finally:
        await client.aclose()


async def test_the_scripts_counting_rule_is_counts(redis_server) -> None:
    """Two descriptors, each of every role, fitting or not, a cost or not, under every
    commit: the script counts a hit exactly when core/exact.py's ``counts`` says (the
    hit fits and its request goes through, or it is a cost), never on a check-only
    call, and only costs on a request denied already."""
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("exact_window.lua")
    await set_test_clock(client, 1_700_000_000_000_000)
    shapes = list(itertools.product(HitRole, (True, False), (True, False)))
    cases = [
        (commit, case)
        for commit in (CHECK, DECIDE, DENIED)
        for case in itertools.product(shapes, repeat=2)
    ]
    try:
        for number, (commit, case) in enumerate(cases):
            # A fitting descriptor has room for its 2 hits (limit 5); one over has 4
            # already (each key starts with 4 hits, counted by a forced call).
            keys = [f"w:60:count:{number}:{i}" for i in range(len(case))]
            for key, (_, fits, _) in zip(keys, case, strict=True):
                if not fits:
                    await client.eval(source, 1, key, 60, 1, 2, 1, 5, 60_000_000, 4, 0)
            hits = [ExactHit(key[5:], 5, 60, 2, role, cost)
                    for key, (role, _, cost) in zip(keys, case, strict=True)]  # fmt: skip
            args = exact_batch_args(60)
            add_exact_request(args, commit, hit_args(hits))
            results = exact_reply(await client.eval(source, len(keys), *keys, *args), 0, len(hits))
            assert [r.admitted for r in results] == [fits for _, fits, _ in case]
            enforce_over = any(role is HitRole.ENFORCE and not fits for role, fits, _ in case)
            quota = [fits for role, fits, _ in case if role is HitRole.QUOTA]
            admitted = commit == DECIDE and not denies(enforce_over, bool(quota), any(quota))
            for key, (_, fits, cost) in zip(keys, case, strict=True):
                held = 0 if fits else 4
                counted = commit != CHECK and counts(fits and admitted, cost)
                in_window = int(await client.hget(key, "sum") or 0)
                assert in_window == held + (2 if counted else 0), (commit, case)
        assert len(cases) == 3 * 12 * 12
    finally:
        await client.aclose()
