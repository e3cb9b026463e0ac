"""Store URLs, parsed and checked without connecting: ``--redis-url`` and
``--global-redis-url`` (core/settings_table.py checks them with :func:`normalize_url`),
read by storage/redis_connect.py to connect.

- ``redis://[user:pass@]host:port/db`` and ``rediss://...`` (TLS): one server.
- ``redis+sentinel://[user:pass@]s1:26379,s2:26379/<master-name>[/db][?sentinel_password=P]``:
  the master that the Sentinels name; the client follows failovers. The credentials are
  the master's; ``sentinel_password`` is the Sentinels' own (REDIS_SENTINEL_AUTH).
- ``redis+cluster://[user:pass@]n1:7000,n2:7001``: a Redis Cluster, discovered from
  the given seed nodes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlparse

from ratelimit_service.core.address import split_host_port


class Topology(enum.Enum):
    SINGLE = "single"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


@dataclass(frozen=True, slots=True)
class Target:
    kind: Topology
    hosts: tuple[tuple[str, int], ...] = ()
    master: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def parse_target(url: str) -> Target:
    """Sentinel and Cluster URLs; single-node URLs are left to redis-py (kind "single")."""
    parsed = urlparse(url)
    if parsed.scheme not in ("redis+sentinel", "redis+cluster"):
        return Target(Topology.SINGLE)
    hosts = tuple(_host(part) for part in parsed.netloc.rpartition("@")[2].split(",") if part)
    if not hosts:
        raise ValueError(f"{url}: no host given")
    path = [part for part in parsed.path.split("/") if part]
    username = unquote(parsed.username) if parsed.username else None
    password = unquote(parsed.password) if parsed.password else None
    if parsed.scheme == "redis+cluster":
        return Target(Topology.CLUSTER, hosts, username=username, password=password)
    if not path:
        raise ValueError(f"{url}: the master name is missing (redis+sentinel://hosts/master)")
    db = int(path[1]) if len(path) > 1 else 0
    sentinel_password = parse_qs(parsed.query).get("sentinel_password", [None])[0]
    return Target(
        Topology.SENTINEL, hosts, unquote(path[0]), db, username, password, sentinel_password
    )


SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")


def normalize_url(text: str, socket_type: str = "tcp") -> str:
    """The store URL for a ``--redis-url`` value, checked: one of SCHEMES, or a Go-style
    ``host:port`` (``socket_type`` tcp) or socket path (unix). Raises ValueError with
    the cause, so a bad value is refused at start-up and never reaches a connect."""
    text = text.strip()
    if "://" not in text:
        if text.startswith("/") or (socket_type == "unix" and ":" not in text):
            if not text:
                raise ValueError("empty socket path")
            return f"unix://{text}"
        _host(text)
        return f"redis://{text}"
    scheme = text.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise ValueError(
            f"unknown scheme {scheme + '://'!r}: use {', '.join(s + '://' for s in SCHEMES)}"
            " or HOST:PORT"
        )
    parsed = urlparse(text)
    if scheme == "unix" and not parsed.path:
        raise ValueError("unix:// needs a socket path")
    if scheme in ("redis", "rediss"):
        try:
            port = parsed.port
        except ValueError:
            raise ValueError(f"bad port in {parsed.netloc.rpartition('@')[2]!r}") from None
        if not parsed.hostname:
            raise ValueError("no host given")
        if port == 0:
            raise ValueError("port 0")
    elif scheme != "unix":
        parse_target(text)
    return text


def _host(text: str) -> tuple[str, int]:
    return split_host_port(text, need_host=True)
