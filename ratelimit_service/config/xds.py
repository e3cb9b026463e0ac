"""Rules by xDS: an ADS state-of-the-world client, as the Go service's GRPC_XDS_SOTW
(Envoy Gateway serves the rules as ``RateLimitConfig`` resources, docs/settings.md).

Each response is the whole rule set (a domain missing from it is gone): its resources
become rule files (:mod:`.xds_yaml`) loaded together, then installed and ACKed, or
NACKed with the loader's errors in ``error_detail`` while the running config stays.

A failed stream reconnects after a backoff (like the Go service's) on a fresh channel,
which re-reads the TLS files, so a rotated certificate is used. An outage is logged once
at WARNING and its end at INFO, the retries in between at DEBUG. The message size,
HTTP/2 keepalive (to notice a silent peer) and a NACK's error text are bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2
from google.rpc import code_pb2

from ratelimit_service.config import rls_conf_pb2
from ratelimit_service.config.xds_settings import Backoff, XdsSettings
from ratelimit_service.config.xds_yaml import TYPE_URL, explain, to_config_file
from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.config_loader import ConfigFile
from ratelimit_service.core.config_model import RateLimitConfig
from ratelimit_service.engine.background import BackgroundTask
from ratelimit_service.engine.stats import Stats

log = logging.getLogger(__name__)

RESOURCE_WRAPPER_URL = "type.googleapis.com/envoy.service.discovery.v3.Resource"
"""Servers may wrap each resource in a discovery Resource (name, ttl); we unwrap it."""
MAX_ERROR_DETAIL = 16 * 1024
"""Characters of loader errors sent in one NACK; the full list is in our log."""
USER_AGENT = "ratelimit-service"


class _Rejected(Exception):
    """A response that cannot be installed; its message goes into the NACK."""

    def __init__(self, messages: Sequence[str]) -> None:
        self.messages = list(messages)
        super().__init__("\n".join(self.messages))


class XdsConfigSource:
    """Keeps the limiter's rules equal to what the xDS server last sent that loads.

    ``load`` turns rule files into a config or raises ConfigLoadError; ``install`` swaps
    it in (``RateLimiter.swap_config``)."""

    def __init__(
        self,
        settings: XdsSettings,
        load: Callable[[list[ConfigFile]], RateLimitConfig],
        install: Callable[[RateLimitConfig], None],
        stats: Stats,
    ) -> None:
        self.settings = settings
        self._load = load
        self._install = install
        self._stats = stats
        self._backoff = Backoff(
            settings.backoff_initial,
            settings.backoff_max,
            settings.backoff_random_factor,
            settings.backoff_jitter,
        )
        self._first = asyncio.Event()
        self._background = BackgroundTask("xds-config", self._run)
        self.version = ""
        """version_info of the last response installed ("" before the first)."""
        self.last_error: str | None = None
        """The text of the last NACK or stream failure, for debugging pages."""
        self.responses = 0
        self._outage_since: float | None = None
        self._outage_retries = 0

    @property
    def loaded(self) -> bool:
        """True once a response has been installed."""
        return self._first.is_set()

    def start(self) -> None:
        """Call from the running event loop."""
        self._background.start()

    async def stop(self) -> None:
        await self._background.stop()

    async def wait_first(self, timeout: float | None = None) -> bool:
        """Wait until a config has been installed; False when ``timeout`` ran out."""
        try:
            await asyncio.wait_for(self._first.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def _run(self) -> None:
        while True:
            answered = self.responses
            try:
                await self._stream()
                reason = "the server ended the stream"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    reason += f" (max_message_size is {self.settings.max_message_size} bytes)"
            except OSError as exc:  # TLS files unreadable
                reason = f"cannot read TLS files: {exc}"
            except Exception as exc:  # the source must outlive any one failure
                log.exception("xDS stream failed")
                reason = f"{type(exc).__name__}: {exc}"
            if self.responses > answered:
                self._backoff.reset()  # it worked for a while: start the waits short again
            delay = self._backoff.next()
            self._note_failure(reason, delay)
            await asyncio.sleep(delay)

    async def _stream(self) -> None:
        channel = self._channel()
        try:
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
            # gRPC wants metadata keys in lower case; HTTP/2 header names are anyway.
            headers = tuple((k.lower(), v) for k, v in self.settings.headers.items())
            call = stub.StreamAggregatedResources(metadata=headers or None)
            # After a reconnect the last accepted version tells the server what we
            # hold; the empty nonce says this is not an answer to any response.
            await call.write(self._request(version=self.version, first=True))
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    return
                self.responses += 1
                self._note_recovered()
                reply = self._handle(response)
                if reply is not None:
                    await call.write(reply)
        finally:
            await channel.close()

    def _channel(self) -> grpc.aio.Channel:
        s = self.settings
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", s.max_message_size),
            ("grpc.max_send_message_length", s.max_message_size),
            ("grpc.keepalive_time_ms", int(s.keepalive_time * 1000)),
            ("grpc.keepalive_timeout_ms", int(s.keepalive_timeout * 1000)),
            ("grpc.http2.max_pings_without_data", 0),  # the stream is quiet between pushes
            ("grpc.primary_user_agent", USER_AGENT),
        ]
        if not s.use_tls:
            return grpc.aio.insecure_channel(s.server_url, options=options)
        if s.server_san:
            options.append(("grpc.ssl_target_name_override", s.server_san))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(s.server_ca),
            private_key=_read(s.client_key),
            certificate_chain=_read(s.client_cert),
        )
        return grpc.aio.secure_channel(s.server_url, credentials, options=options)

    def _request(
        self, *, version: str, nonce: str = "", error: str | None = None, first: bool = False
    ) -> Any:
        request = discovery_pb2.DiscoveryRequest(
            type_url=TYPE_URL, version_info=version, response_nonce=nonce
        )
        if first:  # the node goes on a stream's first request only, as Envoy does
            request.node.CopyFrom(self._node())
        if error is not None:
            request.error_detail.code = code_pb2.INVALID_ARGUMENT
            request.error_detail.message = error
        return request

    def _node(self) -> Any:
        metadata = struct_pb2.Struct()
        metadata.update(dict(self.settings.node_metadata))
        return base_pb2.Node(
            id=self.settings.node_id, metadata=metadata, user_agent_name=USER_AGENT
        )

    def _handle(self, response: Any) -> Any | None:
        """Load and install one response; the ACK or NACK to send back."""
        if response.type_url != TYPE_URL:  # the one type we subscribe to
            log.warning("xDS response of type %s ignored", response.type_url or "(none)")
            return None
        version, nonce = response.version_info, response.nonce
        try:
            files = self._files(response.resources)
            try:
                config = self._load(files)
            except ConfigLoadError as exc:
                raise _Rejected(explain(exc.errors, files)) from exc
            self._install(config)
        except _Rejected as exc:
            return self._reject(version, nonce, exc.messages)
        except Exception as exc:  # a bug must not leave the server waiting for an answer
            log.exception("xDS config version %s not installed", version)
            return self._reject(version, nonce, [f"internal error: {exc}"])
        self._stats.config_load_success += 1
        self.version = version
        self.last_error = None
        self._first.set()
        domains = ",".join(sorted(config.domains)) or "(none)"
        log.info("xDS config version %s installed: domains=%s", version, domains)
        return self._request(version=version, nonce=nonce)

    def _files(self, resources: Sequence[Any]) -> list[ConfigFile]:
        files, problems = [], []
        for index, packed in enumerate(resources):
            try:
                files.append(to_config_file(_unpack(packed)))
            except ValueError as exc:
                problems.append(f"resource {index}: {exc}")
        if problems:
            raise _Rejected(problems)
        return files

    def _reject(self, version: str, nonce: str, messages: list[str]) -> Any:
        self._stats.config_load_error += 1
        for message in messages:
            log.error("xDS config version %s rejected, keeping version %r: %s",
                      version, self.version, message)  # fmt: skip
        text = "\n".join(messages)
        if len(text) > MAX_ERROR_DETAIL:
            text = text[:MAX_ERROR_DETAIL] + "\n... (cut; the rest is in the service's log)"
        self.last_error = text
        return self._request(version=self.version, nonce=nonce, error=text)

    def _note_failure(self, reason: str, delay: float) -> None:
        self.last_error = reason
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self._outage_retries = 0
            held = f"version {self.version!r}" if self.loaded else "no config yet"
            log.warning(
                "xDS stream to %s down (%s); keeping %s, retrying with backoff "
                "(first in %.1fs; retries logged at DEBUG)",
                self.settings.server_url, reason, held, delay,
            )  # fmt: skip
        else:
            self._outage_retries += 1
            log.debug(
                "xDS retry %d failed (%s); next in %.1fs", self._outage_retries, reason, delay
            )

    def _note_recovered(self) -> None:
        if self._outage_since is not None:
            log.info(
                "xDS server %s back after %.1fs and %d retries",
                self.settings.server_url,
                time.monotonic() - self._outage_since,
                self._outage_retries,
            )
            self._outage_since = None


def _unpack(packed: Any) -> Any:
    """The RateLimitConfig inside one resource (an Any, maybe wrapped in a Resource)."""
    if packed.type_url == RESOURCE_WRAPPER_URL:
        wrapper = discovery_pb2.Resource()
        if not _unpack_into(packed, wrapper):
            raise ValueError("undecodable Resource wrapper")
        packed = wrapper.resource
    message = rls_conf_pb2.RateLimitConfig()
    if packed.type_url != TYPE_URL:
        raise ValueError(f"type {packed.type_url or '(none)'}, expected {TYPE_URL}")
    if not _unpack_into(packed, message):
        raise ValueError("undecodable RateLimitConfig")
    return message


def _unpack_into(packed: Any, message: Any) -> bool:
    try:
        return bool(packed.Unpack(message))
    except Exception:  # DecodeError; protobuf's exception types differ by backend
        return False


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None
