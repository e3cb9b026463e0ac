"""A minimal state-of-the-world ADS server for tests (grpc.aio on loopback).

It holds one current response, sends it on every new stream once the client has asked,
pushes new ones to every open stream, and records every request the client sends (the
ACKs and NACKs), so a test can assert on them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2

from ratelimit_service.config import rls_conf_pb2 as rls
from ratelimit_service.config.xds_yaml import TYPE_URL

TIMEOUT = 5.0


class AdsServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    def __init__(self, credentials: grpc.ServerCredentials | None = None) -> None:
        self.credentials = credentials
        self.port = 0
        self.current: Any = None
        self.requests: asyncio.Queue[Any] = asyncio.Queue()
        self.headers: list[dict[str, str]] = []  # each stream's metadata
        self._outboxes: list[asyncio.Queue[Any]] = []
        self._nonces = 0
        self._server: grpc.aio.Server | None = None

    async def start(self, port: int = 0) -> AdsServer:
        self._server = grpc.aio.server()
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self, self._server)
        address = f"127.0.0.1:{port}"
        if self.credentials is None:
            self.port = self._server.add_insecure_port(address)
        else:
            self.port = self._server.add_secure_port(address, self.credentials)
        assert self.port
        await self._server.start()
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    def push(self, version: str, resources: Sequence[Any], *, wrap: bool = False) -> str:
        """Make ``resources`` the state of the world and send it; returns the nonce."""
        self._nonces += 1
        nonce = f"nonce-{self._nonces}"
        response = discovery_pb2.DiscoveryResponse(
            version_info=version, type_url=TYPE_URL, nonce=nonce
        )
        for message in resources:
            packed = any_pb2.Any()
            packed.Pack(message)
            if wrap:
                wrapper = discovery_pb2.Resource(name=message.name, resource=packed)
                packed = any_pb2.Any()
                packed.Pack(wrapper)
            response.resources.append(packed)
        self.current = response
        for outbox in self._outboxes:
            outbox.put_nowait(response)
        return nonce

    async def request(self) -> Any:
        return await asyncio.wait_for(self.requests.get(), TIMEOUT)

    async def StreamAggregatedResources(self, request_iterator: Any, context: Any) -> None:
        self.headers.append({m.key: m.value for m in context.invocation_metadata()})
        first = await context.read()
        if first is grpc.aio.EOF:
            return
        await self.requests.put(first)
        outbox: asyncio.Queue[Any] = asyncio.Queue()
        if self.current is not None:
            outbox.put_nowait(self.current)
        self._outboxes.append(outbox)

        async def read_rest() -> None:
            while (request := await context.read()) is not grpc.aio.EOF:
                await self.requests.put(request)

        reader = asyncio.create_task(read_rest())
        try:
            while True:
                sending = asyncio.create_task(outbox.get())
                await asyncio.wait({sending, reader}, return_when=asyncio.FIRST_COMPLETED)
                if not sending.done():
                    sending.cancel()
                    return
                await context.write(sending.result())
        finally:
            reader.cancel()
            self._outboxes.remove(outbox)


def limit(key: str, per_minute: int, value: str = "", **fields: Any) -> Any:
    return rls.RateLimitDescriptor(
        key=key,
        value=value,
        rate_limit=rls.RateLimitPolicy(unit=rls.MINUTE, requests_per_unit=per_minute),
        **fields,
    )


def domain(name: str, *descriptors: Any, resource: str = "") -> Any:
    return rls.RateLimitConfig(name=resource or name, domain=name, descriptors=descriptors)
