"""A first end-to-end check that the fixtures and the server fit together."""

from __future__ import annotations

from envoy.service.ratelimit.v3 import rls_pb2

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT


async def test_exact_rule_denies_after_limit(write_config, start_service) -> None:
    config = write_config(
        """
        domain: d
        descriptors:
          - key: k
            mode: exact
            rate_limit: {unit: minute, requests_per_unit: 3}
        """
    )
    svc = await start_service(config)
    codes = [(await svc.call("d", [("k", "v")])).overall_code for _ in range(5)]
    assert codes == [OK, OK, OK, OVER, OVER]
