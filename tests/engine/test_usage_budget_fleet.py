"""A probabilistic usage budget held by a fleet: costs one replica counts, denied ones
included, reach the fleet's total through the reconciler's sync (and, with --zone,
through the zone's store, which the same sync feeds), so another replica's checks are
denied once the budget is spent. Two real services on a real Redis.

The other replica only checks the budget: it is granted no share of it, yet its checks
read the fleet's bucket, which it syncs all the same."""

from __future__ import annotations

import re

import pytest

from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.config_model import Mode

RULES = """\
domain: ai
descriptors:
  - key: tenant
    mode: probabilistic
    rate_limit: {unit: hour, requests_per_unit: 6000}
"""
OK, OVER = 1, 2
CHECK = {"entries": [("tenant", "acme")], "hits": 0}


def report(cost: int) -> dict[str, object]:
    return {"entries": [("tenant", "acme")], "hits": cost}


@pytest.mark.parametrize("zoned", [False, True], ids=["one-store", "zone"])
async def test_costs_spent_on_one_replica_deny_the_others_checks(
    start_service, write_config, redis_server, zoned: bool
) -> None:
    config = write_config(RULES)
    stores: dict[str, object] = {"redis_url": redis_server.url}
    if zoned:  # the zone's store on database 1, the global store on database 0
        stores = {
            "redis_url": re.sub(r"/0$", "/1", redis_server.url),
            "global_redis_url": redis_server.url,
            "zone": "a",
        }
    a, b = [
        await start_service(config, mode=Mode.PROBABILISTIC, sync_interval=0.1, **stores)
        for _ in range(2)
    ]
    assert (await b.call("ai", CHECK)).overall_code == OK
    # 9 reports of 700 (6,300 on 6,000): the last ones do not fit, and count all the same.
    answers = [(await a.call("ai", report(700))).overall_code for _ in range(9)]
    assert OVER in answers  # some did not fit (an over answer Envoy ignores)

    async def b_denied() -> bool:
        return (await b.call("ai", CHECK)).overall_code == OVER

    await eventually_async(b_denied, timeout=10, what="the other replica's check denied")
    assert (await a.call("ai", CHECK)).overall_code == OVER
