"""The status page of a real service after real traffic: /status.json's values against
the calls made (some denied) and the RLQS assignments the streams received, and /status
rendered by headless Chromium, its script having filled the tables from the JSON."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_harness.browser import chromium, dump_dom
from ratelimit_harness.fixtures import RunningService
from ratelimit_harness.fleet import redis_server as fleet_redis
from ratelimit_harness.rlqs_sim import usage_report
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.storage.base import StoreMetrics

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT

RULES = """
domain: d
descriptors:
  - key: k
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: p
    mode: probabilistic
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: tenant
    rate_limit: {unit: day, requests_per_unit: 86400}
"""
"""The RLQS rule counts its fleet's hits per day: a test crosses a day's end (which
starts the count again) far less often than a minute's."""

Starter = Callable[..., Awaitable[RunningService]]
Json = dict[str, Any]


async def get(port: int, path: str) -> tuple[int, str, bytes]:
    """GET on a fresh connection (the service shares this loop): status, type, body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers["content-type"], body


async def snapshot(port: int) -> Json:
    status, content_type, body = await get(port, "/status.json")
    assert (status, content_type) == (200, "application/json")
    return dict(json.loads(body))


class Tables(HTMLParser):
    """Each table's body rows in a DOM, by the table's id: (data-key, cell texts)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[tuple[str, list[str]]]] = {}
        self.captions: dict[str, str] = {}
        self.body: dict[str, str] = {}
        self._table = self._cell = ""
        self._in_body = self._in_caption = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = {name: value or "" for name, value in attrs}
        if tag == "body":
            self.body = named
        elif tag == "table":
            self._table = named.get("id", "")
            self.tables[self._table] = []
        elif tag == "tbody":
            self._in_body = True
        elif tag == "caption":
            self._in_caption = True
            self.captions[self._table] = ""
        elif tag == "tr" and self._in_body:
            self.tables[self._table].append((named.get("data-key", ""), []))
        elif tag == "td" and self._in_body:
            self.tables[self._table][-1][1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self._in_body = False
        elif tag == "caption":
            self._in_caption = False

    def handle_data(self, data: str) -> None:
        if self._in_caption:
            self.captions[self._table] += data
        elif self._in_body and self.tables[self._table] and self.tables[self._table][-1][1]:
            self.tables[self._table][-1][1][-1] += data


def rendered(dom: str) -> Tables:
    tables = Tables()
    tables.feed(dom)
    return tables


class Envoy:
    """One RLQS stream, named as Envoy names it."""

    def __init__(self, service: RunningService, name: str) -> None:
        stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(service.channel)
        self.call = stub.StreamRateLimitQuotas(metadata=(("x-envoy-node-id", name),))

    async def report(self, bucket: dict[str, str]) -> float:
        """One report; the tokens per second of the token bucket assigned in answer."""
        await self.call.write(usage_report("d", bucket, 1, 0, 0))
        answer: rlqs_pb2.RateLimitQuotaResponse = await asyncio.wait_for(self.call.read(), 10)
        (action,) = answer.bucket_action
        strategy = action.quota_assignment_action.rate_limit_strategy.token_bucket
        return float(strategy.tokens_per_fill.value / strategy.fill_interval.seconds)


async def traffic(service: RunningService) -> dict[str, float]:
    """8 calls on the exact 5/minute rule (3 denied), 4 on the probabilistic one, and two
    Envoys' reports on the RLQS rule: what each Envoy was assigned, per second."""
    codes = [(await service.call("d", [("k", "1")])).overall_code for _ in range(8)]
    assert codes == [OK] * 5 + [OVER] * 3
    for _ in range(4):
        assert (await service.call("d", [("p", "a")])).overall_code == OK
    assigned = {}
    for name in ("envoy-a", "envoy-b"):
        assigned[name] = await Envoy(service, name).report({"tenant": "t"})
    return assigned


async def after_the_traffic(port: int) -> Json:
    """The first snapshot made after the calls (a snapshot is served for FRESH_FOR)."""

    async def made_after() -> Json | None:
        current = await snapshot(port)
        rules = {row["key"]: row for row in current["rules"]["rows"]}
        return current if "d.k" in rules and rules["d.k"]["hits"] == 8 else None

    return await eventually_async(made_after, what="a snapshot made after the calls")


async def test_status_json_after_real_traffic(write_config: Any, start_service: Starter) -> None:
    service = await start_service(write_config(RULES))
    port = service.service.admin.port
    first = await snapshot(port)
    assert first["rate_interval_seconds"] is None  # the sample the rates are measured against
    assigned = await traffic(service)
    status = await after_the_traffic(port)
    interval = status["rate_interval_seconds"]
    rules = {row["key"]: row for row in status["rules"]["rows"]}
    k, p = rules["d.k"], rules["d.p"]
    assert (k["hits"], k["denied"], k["denied_share"], k["total_denied"]) == (8, 3, 0.375, 3)
    assert k["near_limit"] == 1  # the 5th of 5 is past 80 % (4); denied hits are over, not near
    assert (k["limit"], k["mode"], p["limit"], p["mode"]) == (
        "5/minute", "exact", "100/minute", "probabilistic",
    )  # fmt: skip
    assert k["rate"] == pytest.approx(8 / interval, rel=0.01)
    assert (p["hits"], p["denied"], p["denied_share"]) == (4, 0, 0.0)
    assert [row["key"] for row in status["rules"]["rows"][:2]] == ["d.k", "d.p"]  # by rate
    assert status["rules"]["loaded"] == 3 and status["rules"]["denied_share"] == round(
        3 / 14, 4
    )  # and 2 RLQS hits
    assert status["service"]["requests"] == 12

    keys = {row["key"]: row for row in status["keys"]["rows"]}
    bucket = keys["d.p=a/60s"]
    assert (bucket["kind"], bucket["rule"], bucket["limit"]) == (
        "probabilistic",
        "d.p",
        "100/minute",
    )
    assert bucket["used"] == 0.04  # 4 of the 100 the bucket holds
    exact = keys["d.k=1/60s"]  # seen over its limit: its count as the store answered
    assert (exact["kind"], exact["rule"], exact["limit"], exact["used"]) == (
        "exact", "d.k", "5/minute", 1.0,
    )  # fmt: skip
    assert [row["kind"] for row in status["keys"]["rows"][:1]] == ["exact"]  # the closest
    counter = keys["d.tenant=t/86400s"]
    assert (counter["kind"], counter["limit"]) == ("rlqs", "86400/day")

    rlqs = status["rlqs"]
    assert (rlqs["streams"], rlqs["reports"], rlqs["envoys"]["total"]) == (2, 2, 2)
    envoys = {row["name"]: row for row in rlqs["envoys"]["rows"]}
    for name, per_second in assigned.items():
        assert envoys[name]["assigned"] == round(per_second, 3)  # the bucket it was sent
        # Their shares: envoy-a first had the whole 86400/day; envoy-b came second, to an
        # even half (envoy-a's shrinks at its own next report).
        assert (envoys[name]["counters"], envoys[name]["busiest"]) == (1, "d.tenant=t/86400s")
    assert (envoys["envoy-a"]["share"], envoys["envoy-b"]["share"]) == (1.0, 0.5)
    (row,) = rlqs["counters"]["rows"]
    assert (row["instances"], row["part"], row["used"]) == (2, 86400.0, 2)  # 2 hits allowed
    assert status["store"]["name"] == "embedded" and status["store"]["healthy"] is True
    assert status["zone"] is None and status["reconciler"]["buckets"] == 1

    code, content_type, page = await get(port, "/status")
    assert (code, content_type) == (200, "text/html; charset=utf-8")
    assert b"status.json" in page and b"<script>" in page
    assert b"/status\n/status.json\n" in (await get(port, "/"))[2]


def browser() -> str:
    binary = chromium()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return binary


@pytest.mark.slow  # a Chromium process
async def test_the_page_renders_the_snapshot_in_chromium(
    write_config: Any, start_service: Starter
) -> None:
    browser()
    service = await start_service(write_config(RULES))
    port = service.service.admin.port
    await snapshot(port)
    await traffic(service)
    await after_the_traffic(port)  # the snapshot the page will be served
    dom = await dump_dom(f"http://127.0.0.1:{port}/status")
    page = rendered(dom)
    assert page.body.get("data-rendered"), "the script rendered no snapshot"
    rules = dict(page.tables["rules"])
    # Stats key, limit, mode, calls/s, denied, near limit, hits and denied since start.
    assert rules["d.k"][1:3] == ["5/minute", "exact"]
    assert rules["d.k"][6:] == ["8", "3"]
    assert rules["d.p"][6:] == ["4", "0"]
    assert page.captions["rules"].startswith("Busiest stats keys: 3 shown of 3")
    keys = dict(page.tables["keys"])
    assert keys["d.p=a/60s"][:5] == ["d.p=a/60s", "probabilistic", "d.p", "100/minute", "4.0 %"]
    envoys = dict(page.tables["envoys"])
    assert set(envoys) == {"envoy-a", "envoy-b"}
    # Envoy, counters, demand, share/s, token buckets/s, busiest counter, its share, limit.
    assert envoys["envoy-a"][3:] == ["1.00", "1.00", "d.tenant=t/86400s", "86400", "86400/day"]
    assert envoys["envoy-b"][3:6] == ["0.50", "1.00", "d.tenant=t/86400s"]
    (counter,) = page.tables["counters"]
    # Counter, limit, Envoys here and in the fleet, replicas, this replica's part, (the
    # fleet's demand: Envoys not measured yet count as even shares of the limit's rate,
    # by the fleet's count at the last publish), and the hits used in the window.
    cells = counter[1]
    assert cells[:6] + cells[7:] == ["d.tenant=t/86400s", "86400/day", "2", "2", "1", "86400", "2"]
    assert dict(page.tables["breakers"]) == {}  # the embedded store has none
    figures = {cells[0]: cells[1] for _, cells in page.tables["store-figures"]}
    assert set(figures) == {"evictions", "exact_keys", "fleet_keys", "swept"}


async def test_zone_and_breakers_of_a_zoned_replica(
    write_config: Any, start_service: Starter, redis_server: Any, tmp_path: Path
) -> None:
    """With --zone on real Redis servers: the zoned store's two breakers (the global
    Redis and the zone's) and the zone's aggregator, which this lone replica becomes."""
    with fleet_redis(tmp_path / "global") as above:
        service = await start_service(
            write_config(RULES),
            redis_url=redis_server.url,
            zone="z1",
            global_redis_url=above.url,
            zone_interval=0.2,
        )
        port = service.service.admin.port

        async def aggregating() -> Json | None:
            current = await snapshot(port)
            return current if current["zone"]["aggregating"] else None

        status = await eventually_async(aggregating, what="the replica aggregating its zone")
        await service.service.stop()
    zone, store = status["zone"], status["store"]
    assert (zone["zone"], zone["global_away"], store["name"], store["healthy"]) == (
        "z1", False, "zoned", True,
    )  # fmt: skip
    assert zone["figures"]["zone_takeovers"] == 1
    breakers = {b["name"]: (b["open"], b["healthy"]) for b in store["breakers"]}
    assert breakers == {"store": (False, True), "zone store": (False, True)}


async def test_a_failing_snapshot_answers_500_and_the_port_keeps_serving(
    write_config: Any, start_service: Starter
) -> None:
    service = await start_service(write_config(RULES))
    port = service.service.admin.port

    def broken() -> StoreMetrics:
        raise RuntimeError("figures unavailable")

    service.service.store.metrics = broken  # type: ignore[method-assign]
    status, content_type, body = await get(port, "/status.json")
    assert (status, content_type, body) == (
        500, "text/plain", b"status snapshot failed: figures unavailable\n",
    )  # fmt: skip
    assert (await get(port, "/healthcheck"))[0] == 200
