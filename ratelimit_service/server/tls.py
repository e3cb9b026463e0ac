"""TLS for the gRPC listener, with optional client certificates and live rotation.

gRPC asks the fetcher before every new connection's handshake; it answers with a new
certificate configuration only when a file changed on disk (an ``os.stat`` per
connection, rare with Envoy's long-lived ones), so rotated certificates apply without
a restart and existing connections are left alone. The native front door's handshakes
(an ``ssl.SSLContext``, ALPN h2) ask the same question from their ClientHello callback.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

log = logging.getLogger(__name__)

T = TypeVar("T")


class CertificateReloader:
    def __init__(self, cert: str | Path, key: str | Path, client_ca: str | Path | None) -> None:
        self.paths = [Path(cert), Path(key)] + ([Path(client_ca)] if client_ca else [])
        self.require_client_auth = client_ca is not None
        self._stamp = self._stamps()
        self.reloads = 0

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        # os.stat follows symlinks: a Secret volume's ..data swap shows.
        return tuple((info.st_mtime_ns, info.st_ino) for info in map(os.stat, self.paths))

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key = self.paths[0].read_bytes(), self.paths[1].read_bytes()
        root = self.paths[2].read_bytes() if self.require_client_auth else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=root)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """The fetcher gRPC calls per handshake: a new configuration, or None to keep."""
        return self._reloaded(self.configuration)

    def _reloaded(self, build: Callable[[], T]) -> T | None:
        """``build()`` if a file changed since the last load (counted), else None; None
        too, logged, if the new files cannot be used (the current ones stay)."""
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            built = build()
        except (OSError, ValueError, ssl.SSLError) as exc:
            log.error("TLS files not reloaded, keeping the current ones: %s", exc)
            return None
        self._stamp = stamp
        self.reloads += 1
        log.info("TLS certificates reloaded")
        return built

    def ssl_context(self) -> ssl.SSLContext:
        """The native front door's context: h2 by ALPN, TLS 1.2 or later, the client's
        certificate required when a client CA is given. Each handshake looks at the files
        first and takes a context built anew from them if they changed."""
        context = self._new_context()
        latest = [context]

        def on_hello(connection: Any, server_name: str | None, current: ssl.SSLContext) -> None:
            rebuilt = self._reloaded(self._new_context)
            if rebuilt is not None:
                latest[0] = rebuilt
            if latest[0] is not current:
                connection.context = latest[0]

        context.sni_callback = on_hello
        return context

    def _new_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.paths[0], self.paths[1])
        if self.require_client_auth:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(self.paths[2])
        context.set_alpn_protocols(["h2"])
        return context

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.configuration(), self.fetch, require_client_authentication=self.require_client_auth
        )
