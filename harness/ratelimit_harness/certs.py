"""Throw-away certificates for TLS tests, made with the openssl command line."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path, name: str = "ca") -> CertPair:
    directory.mkdir(parents=True, exist_ok=True)
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
         str(cert), "-days", "2", "-subj", f"/CN=test {name}", cwd=directory)  # fmt: skip
    return CertPair(cert, key)


def make_cert(
    directory: Path, ca: CertPair, name: str, client: bool = False, server: bool | None = None
) -> CertPair:
    """A leaf certificate for localhost / 127.0.0.1 signed by ``ca``: a server's, or with
    ``client`` a client's; ``client`` and ``server`` both for one used both ways (as Envoy
    Gateway's certificate for the rate-limit service is)."""
    key, csr, cert = (directory / f"{name}.{ext}" for ext in ("key", "csr", "pem"))
    ext = directory / f"{name}.ext"
    server = not client if server is None else server
    usage = ",".join(u for u, on in (("serverAuth", server), ("clientAuth", client)) if on)
    ext.write_text(
        f"subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage={usage}\n"
        "basicConstraints=CA:FALSE\n"
    )
    _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
         "-subj", f"/CN={name}", cwd=directory)  # fmt: skip
    _run("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key),
         "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext),
         cwd=directory)  # fmt: skip
    return CertPair(cert, key)
