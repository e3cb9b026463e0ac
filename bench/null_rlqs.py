"""A null RLQS server: every bucket of every report gets one fixed token bucket that is
never reached, at once. The floor for what an RLQS server costs Envoy: Envoy's own
rate_limit_quota filter, with coordination that costs nothing.

    python bench/null_rlqs.py --port 18081
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from envoy.type.v3 import ratelimit_strategy_pb2, token_bucket_pb2

_Action = rlqs_pb2.RateLimitQuotaResponse.BucketAction
NEVER_REACHED = ratelimit_strategy_pb2.RateLimitStrategy(
    token_bucket=token_bucket_pb2.TokenBucket(
        max_tokens=1_000_000_000,
        tokens_per_fill={"value": 1_000_000_000},
        fill_interval={"seconds": 1},
    )
)


class NullQuota:
    async def StreamRateLimitQuotas(
        self, reports: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for message in reports:
            actions = [
                _Action(
                    bucket_id=usage.bucket_id,
                    quota_assignment_action=_Action.QuotaAssignmentAction(
                        assignment_time_to_live={"seconds": 3600},
                        rate_limit_strategy=NEVER_REACHED,
                    ),
                )
                for usage in message.bucket_quota_usages
            ]
            if actions:
                yield rlqs_pb2.RateLimitQuotaResponse(bucket_action=actions)


async def serve(port: int) -> None:
    server = grpc.aio.server()
    rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server(NullQuota(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
