"""A rule of N per unit admits N: a fresh key's first unit, in both modes, on a real
service, sent serially or all at once; shadow rules count as would-deny only what the
written limit would have denied. And a rule's opt-in ``burst`` stores less."""

from __future__ import annotations

import asyncio

import pytest

from ratelimit_harness.fixtures import make_request
from ratelimit_service.core.config_model import Mode

RULES = """\
domain: fresh
descriptors:
  - key: per_second
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: per_minute
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: half
    rate_limit: {unit: second, requests_per_unit: 10, burst: 5}
"""
OVER = 2

MODES = [Mode.PROBABILISTIC, Mode.EXACT]


async def _at_once(service, key: str, count: int) -> list:
    request = make_request("fresh", [(key, "v")])
    return await asyncio.gather(*(service.stub.ShouldRateLimit(request) for _ in range(count)))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize(("key", "limit", "sent"), [("per_second", 10, 12), ("per_minute", 5, 7)])
async def test_a_fresh_key_admits_its_limit_at_once(
    start_service, write_config, mode: Mode, key: str, limit: int, sent: int
) -> None:
    service = await start_service(write_config(RULES), mode=mode, sync_interval=60.0)
    responses = await _at_once(service, key, sent)
    assert sum(r.overall_code != OVER for r in responses) == limit
    remaining = sorted(r.statuses[0].limit_remaining for r in responses)
    assert remaining[-1] == limit - 1  # after the first hit: N - 1


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
async def test_serial_calls_admit_the_limit(start_service, write_config, mode: Mode) -> None:
    service = await start_service(write_config(RULES), mode=mode)
    request = make_request("fresh", [("per_second", "serial")])
    codes = [(await service.stub.ShouldRateLimit(request)).overall_code for _ in range(12)]
    assert codes.count(OVER) == 2
    assert codes[:10] == [codes[0]] * 10 and codes[0] != OVER


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
async def test_shadow_counts_only_what_the_limit_would_deny(
    start_service, write_config, mode: Mode
) -> None:
    service = await start_service(write_config(RULES), mode=mode, sync_interval=60.0)
    responses = await _at_once(service, "shadow", 12)
    assert all(r.overall_code != OVER for r in responses)  # shadow never denies
    rule = service.service.stats.rules["fresh.shadow"]
    assert (rule.total_hits, rule.within_limit, rule.shadow_mode) == (12, 10, 2)


async def test_a_rule_s_burst_caps_what_a_fresh_key_admits_at_once(
    start_service, write_config
) -> None:
    service = await start_service(write_config(RULES), mode=Mode.PROBABILISTIC, sync_interval=60.0)
    responses = await _at_once(service, "half", 12)
    assert sum(r.overall_code != OVER for r in responses) == 5
    assert max(r.statuses[0].limit_remaining for r in responses) == 4
