"""A null RLS server: answers OK to every ShouldRateLimit and does nothing else.

It is the ceiling a Python grpc.aio service can reach on this machine; our figures
are quoted as ratios to it, measured side by side in one run.

    python bench/null_server.py --port 18090
    python bench/null_server.py --port 18090 --uvloop --native   # the native front door's
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

_OK = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)


class NullServicer(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    async def ShouldRateLimit(self, request, context):
        return _OK


async def serve(port: int) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(NullServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def serve_native(port: int) -> None:
    """The same answer from the native front door (--grpc-engine native's HTTP/2): its
    ceiling. Connections that begin with another method find no grpcio behind it."""
    from ratelimit_service.server.native_grpc import BackendSocket, NativeGrpcServer, Route

    answer = _OK.SerializeToString()
    path = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    nowhere = BackendSocket("unix:/nonexistent", "/nonexistent")
    server = NativeGrpcServer({path: Route(lambda raw: answer)}, nowhere, 1 << 20)
    await server.start(f"127.0.0.1:{port}")
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=18090)
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop's event loop")
    parser.add_argument("--native", action="store_true", help="the native front door, not grpcio")
    args = parser.parse_args()
    main = serve_native(args.port) if args.native else serve(args.port)
    if args.uvloop:
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)
