"""``HOST:PORT``, parsed one way for every listener, store and Envoy address."""

from __future__ import annotations


def split_host_port(
    text: str, *, need_host: bool = False, any_port: bool = False
) -> tuple[str, int]:
    """(host, port) of ``HOST:PORT``: an IPv6 host is written in brackets and returned without them;
    an empty host (``:9090``) is returned empty unless ``need_host``. The port is 1 to 65535 (0 too
    with ``any_port``: the system picks one). Raises ValueError naming what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"unbalanced brackets in {text!r}")
    number = int(port)
    if not (0 if any_port else 1) <= number <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    host = host[1:-1] if host.startswith("[") else host
    if need_host and not host:
        raise ValueError(f"no host in {text!r}")
    return host, number


def listen_host(host: str) -> str:
    """The address to bind for a parsed host: every address when it is empty."""
    return host or "0.0.0.0"
