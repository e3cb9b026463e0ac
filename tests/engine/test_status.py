"""The status snapshot over the engine's own objects, on injected clocks: rates measured
against earlier samples, every table bounded with its totals, the RLQS Envoys' demand and
shares as the coordinator holds them, one snapshot shared by its readers, and the work
done in pieces."""

from __future__ import annotations

import asyncio
import json

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.local_buckets import LocalBuckets
from ratelimit_service.engine.counters import DOMAIN_NOT_FOUND, KEY_COUNTERS, SERVICE_COUNTERS
from ratelimit_service.engine.quota import QuotaCoordinator, Usage
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.engine.stats import SLICE, Stats
from ratelimit_service.engine.status import (
    FRESH_FOR,
    RATE_WINDOW,
    TOP,
    Baselines,
    Sample,
    StatusBoard,
    StatusSources,
    Top,
)
from ratelimit_service.storage.embedded import EmbeddedStore

RULES = """
domain: d
descriptors:
  - key: k
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: p
    mode: probabilistic
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 6}
"""


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def board(*more: str) -> tuple[StatusBoard, Clock]:
    clock = Clock()
    files = [ConfigFile(f"rules{n}.yaml", text) for n, text in enumerate((RULES, *more))]
    config = load_config(files)
    stats, store, local = Stats(), EmbeddedStore(clock=clock), LocalBuckets()
    quota = QuotaCoordinator(lambda: config, stats, store, clock=clock, wall=clock)
    sources = StatusSources(
        stats, lambda: config, local, store, Reconciler(local, store, 0.25), quota
    )
    return StatusBoard(sources, clock=clock, wall=clock), clock


def count(stats: Stats, key: str, hits: int, denied: int = 0, near: int = 0) -> None:
    rule = stats.rule(key)
    rule.total_hits += hits
    rule.over_limit += denied
    rule.within_limit += hits - denied
    rule.near_limit += near
    stats.total_requests += hits


def rows(table: dict[str, object]) -> dict[str, dict[str, object]]:
    return {row["key"]: row for row in table["rows"]}  # type: ignore[attr-defined, index]


async def test_rates_denied_share_and_near_limit_over_the_interval() -> None:
    status, clock = board()
    stats = status.sources.stats
    count(stats, "d.k", 10, denied=2, near=1)
    first = await status.snapshot()
    assert first["rate_interval_seconds"] is None  # nothing to measure against yet
    row = rows(first["rules"])["d.k"]
    assert (row["total_hits"], row["total_denied"], row["rate"]) == (10, 2, None)
    assert (row["limit"], row["mode"], first["rules"]["loaded"]) == ("5/minute", "exact", 3)

    count(stats, "d.k", 40, denied=10, near=3)
    count(stats, "d.p", 4)
    clock.now += 2.0
    second = await status.snapshot()
    assert second["rate_interval_seconds"] == 2.0
    k, p = rows(second["rules"])["d.k"], rows(second["rules"])["d.p"]
    assert (k["hits"], k["denied"], k["near_limit"], k["rate"]) == (40, 10, 3, 20.0)
    assert (k["denied_share"], k["total_hits"], k["total_denied"]) == (0.25, 50, 12)
    assert (p["hits"], p["rate"], p["denied_share"]) == (4, 2.0, 0.0)
    assert [r["key"] for r in second["rules"]["rows"]] == ["d.k", "d.p"]  # by rate
    assert second["rules"]["rate"] == 22.0 and second["rules"]["denied_share"] == 0.2273
    assert second["service"]["rate"] == 22.0 and second["service"]["requests"] == 54


async def test_the_page_shows_every_counter_the_catalogue_gives_a_status_key() -> None:
    """engine/counters.py: a service counter under its key (a per-domain one summed), a
    stats key's counters in its row, counted over the interval."""
    status, clock = board()
    stats = status.sources.stats
    rule = stats.rule("d.k")
    await status.snapshot()
    for n, counter in enumerate(KEY_COUNTERS, 1):
        setattr(rule, counter.attr, n)
    for n, counter in enumerate(SERVICE_COUNTERS, 100):
        setattr(stats, counter.attr, n)
    stats.domain_not_found.update(nope=5, other=6)
    clock.now += 2.0
    snapshot = await status.snapshot()
    row = rows(snapshot["rules"])["d.k"]
    for n, counter in enumerate(KEY_COUNTERS, 1):
        if counter.status is not None:
            assert row[counter.status] == n, counter
    service = snapshot["service"]
    for n, counter in enumerate(SERVICE_COUNTERS, 100):
        if counter.status is not None:
            assert service[counter.status] == n, counter
    assert service[str(DOMAIN_NOT_FOUND.status)] == 11


async def test_a_snapshot_is_shared_while_fresh_and_by_readers_at_once() -> None:
    status, clock = board()
    stats = status.sources.stats
    together = await asyncio.gather(*(status.json() for _ in range(5)))
    assert all(body is together[0] for body in together)  # one computation for all
    count(stats, "d.k", 3)
    clock.now += FRESH_FOR / 2
    assert await status.json() is together[0]  # still fresh: the same bytes
    clock.now += FRESH_FOR
    fresh = json.loads(await status.json())
    assert rows(fresh["rules"])["d.k"]["hits"] == 3


def test_baselines_keep_a_reference_between_one_and_two_windows_old() -> None:
    baselines, ages = Baselines(), []
    for step in range(41):  # polled every second for 40 s
        now = float(step)
        reference = baselines.reference(now)
        ages.append(None if reference is None else now - reference.at)
        baselines.keep(Sample(now, {}, 0))
    assert ages[0] is None
    steady = [age for age in ages[int(2 * RATE_WINDOW) :] if age is not None]
    assert min(steady) >= RATE_WINDOW and max(steady) <= 2 * RATE_WINDOW
    assert len(baselines.samples) <= 2
    assert baselines.reference(100.0) is None  # a quiet spell: measure anew


def test_top_keeps_the_highest_ranks_and_counts_the_rest() -> None:
    top: Top[str] = Top(3)
    for n, rank in enumerate([5, 1, 9, 7, 7, 3]):
        top.offer((rank,), f"item{n}")
    assert top.best() == ["item2", "item3", "item4"]  # 9, then the first of the 7s
    table = top.table([{"key": name} for name in top.best()])
    assert (table["total"], table["shown"], table["more"]) == (6, 3, 3)


async def test_tables_stay_bounded_with_10000_stats_keys_and_1000_envoys() -> None:
    """10,000 stats keys with traffic and their buckets, and 1,000 RLQS Envoys: each table
    holds TOP rows with the totals, and the JSON stays under 64 KB. (Loading 10,000 rules
    takes seconds of YAML: tests/server/test_status_page.py does it in a service.)"""
    status, clock = board()
    src = status.sources
    for n in range(10_000):
        count(src.stats, f"m.r_v{n}", n % 97)
        bucket = src.local.get(f"m\x1fr\x1ev{n}\x1f60", 100, 60, clock.now, f"m.r_v{n}")
        bucket.take(n % 50, 0.5)
    for n in range(1_000):  # 1,000 Envoys over 100 counters
        await src.quota.report(f"envoy-{n}", "d", [Usage({"tenant": f"t{n % 100}"}, 1, 0)])
    snapshot = await status.snapshot()
    body = await status.json()
    assert len(body) < 64_000, len(body)
    rules, keys = snapshot["rules"], snapshot["keys"]
    total = 10_000 + 1  # and d.tenant, counted by the RLQS reports
    assert (rules["total"], rules["shown"], rules["more"]) == (total, TOP, total - TOP)
    assert rules["rows"][0]["total_hits"] == 1_000  # d.tenant: 1,000 reports of one hit
    assert rules["rows"][1]["total_hits"] == 96  # then the busiest since the start
    assert (keys["total"], keys["shown"]) == (10_000 + 100, TOP)
    envoys, counters = snapshot["rlqs"]["envoys"], snapshot["rlqs"]["counters"]
    assert (envoys["total"], envoys["shown"], envoys["more"]) == (1_000, TOP, 1_000 - TOP)
    assert (counters["total"], counters["shown"], counters["more"]) == (100, TOP, 100 - TOP)
    # It may return to the loop every SLICE items (how long each piece holds it is a
    # timing matter: tests/server/test_status_bounds.py, run alone, holds that).
    assert snapshot["took"]["pieces"] > 2 * 10_000 // SLICE


async def test_rlqs_envoys_show_the_demand_and_share_the_coordinator_holds() -> None:
    status, clock = board()
    quota = status.sources.quota
    bucket = {"tenant": "t"}
    await quota.report("envoy-a", "d", [Usage(bucket, 1, 0)])
    await quota.report("envoy-b", "d", [Usage(bucket, 1, 0)])
    clock.now += 5.0
    (a,) = await quota.report("envoy-a", "d", [Usage(bucket, 20, 5)])  # 5 calls/s
    (b,) = await quota.report("envoy-b", "d", [Usage(bucket, 5, 0)])  # 1 call/s
    snapshot = await status.snapshot()
    envoys = {row["name"]: row for row in snapshot["rlqs"]["envoys"]["rows"]}
    assert [row["name"] for row in snapshot["rlqs"]["envoys"]["rows"]] == ["envoy-a", "envoy-b"]
    assert envoys["envoy-a"]["demand"] == 5.0 and envoys["envoy-b"]["demand"] == 1.0
    for row, action in ((envoys["envoy-a"], a), (envoys["envoy-b"], b)):
        assert action.token_bucket is not None
        bucket = action.token_bucket
        assert row["assigned"] == round(bucket.tokens_per_fill / bucket.fill_seconds, 3)
        assert row["busiest"] == "d.tenant=t/1s" and row["busiest_limit"] == "6/second"
    (counter,) = snapshot["rlqs"]["counters"]["rows"]
    assert (counter["instances"], counter["part"], counter["demand"]) == (2, 6.0, 6.0)
    (key,) = [row for row in snapshot["keys"]["rows"] if row["kind"] == "rlqs"]
    assert key["used"] == 1.0  # a rule per second: the fleet's demand over the limit
    assert snapshot["rlqs"]["streams"] == 0 and snapshot["rlqs"]["reports"] == 4


async def test_exact_keys_show_while_their_window_may_still_hold_their_count() -> None:
    status, clock = board()
    near = status.sources.stats.near_keys
    status.sources.stats.near_key("d\x1fk\x1e1\x1f60", "d.k", 7, 5, 60)
    near.items()[0][1].seen = clock.now - 30  # seen half a window ago
    (row,) = [row for row in (await status.snapshot())["keys"]["rows"] if row["kind"] == "exact"]
    assert (row["rule"], row["used"], row["limit"]) == ("d.k", 1.0, "5/minute")  # capped
    near.items()[0][1].seen = clock.now - 60  # a whole window ago: drained
    clock.now += FRESH_FOR
    rows_now = (await status.snapshot())["keys"]["rows"]
    assert [row for row in rows_now if row["kind"] == "exact"] == []


async def test_store_and_reconciler_state() -> None:
    status, _ = board()
    snapshot = await status.snapshot()
    store = snapshot["store"]
    assert (store["name"], store["healthy"], store["breakers"]) == ("embedded", True, [])
    assert set(store["figures"]) == {"exact_keys", "fleet_keys", "evictions", "swept"}
    assert snapshot["reconciler"]["rounds"] == 0 and snapshot["zone"] is None
