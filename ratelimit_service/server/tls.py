"""TLS for the gRPC listener, with optional client certificates and live rotation.

gRPC asks the fetcher before every new connection's handshake; it answers with a new
certificate configuration only when a file changed on disk (an ``os.stat`` per
connection, rare with Envoy's long-lived ones), so rotated certificates apply without
a restart and existing connections are left alone.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


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
        try:
            stamp = self._stamps()
            if stamp == self._stamp:
                return None
            configuration = self.configuration()
        except (OSError, ValueError) as exc:
            log.error("TLS files not reloaded, keeping the current ones: %s", exc)
            return None
        self._stamp = stamp
        self.reloads += 1
        log.info("TLS certificates reloaded")
        return configuration

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.configuration(), self.fetch, require_client_authentication=self.require_client_auth
        )
