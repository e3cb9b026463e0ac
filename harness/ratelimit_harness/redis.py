"""Real redis-server processes on free loopback ports, owned by a test or a benchmark:
a single server, a Redis Cluster, a master/replica pair watched by a Sentinel."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ratelimit_harness.waiting import eventually

PORTS_FROM, PORTS_EACH, SLICES = 10_000, 2_500, 4
"""free_port's ports: 10,000-19,999, in a slice of 2,500 per pytest-xdist worker (modulo
four), below the kernel's ephemeral range, and their cluster bus ports (+10,000) too."""


def _port_numbers() -> Iterator[int]:
    """This process's slice of ports, in turn from a random start (a port a run before
    left in TIME_WAIT is not tried first), round and round."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = PORTS_FROM + PORTS_EACH * (int(worker) % SLICES if worker.isdigit() else 0)
    start = random.randrange(PORTS_EACH)
    while True:
        for offset in range(PORTS_EACH):
            yield first + (start + offset) % PORTS_EACH


_PORTS = _port_numbers()


def free_port() -> int:
    """A loopback port nothing listens on, for a server a test starts. Not a port the
    kernel hands out (port 0): its ephemeral range is where every outgoing connection
    takes its own port, and one may take it between this check and the server's bind
    (seen under parallel workers). Where that range starts below the slices, port 0."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(PORTS_EACH) if low > PORTS_FROM + PORTS_EACH * SLICES + 10_000 else ():
        port = next(_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_redis(port: int, directory: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A redis-server with persistence off, its files and log in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", str(directory),
               "--logfile", str(directory / "redis.log"), *extra]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ping(port: int, timeout: float = 10.0) -> None:
    """Until a Redis server on ``port`` answers PING."""

    def pong() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    eventually(pong, timeout=timeout, what=f"PONG on port {port}")


def _cli(port: int, *args: str) -> str:
    result = subprocess.run(
        ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=30
    )
    return result.stdout


class RedisServer:
    """start/stop/pause/resume one redis-server process."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._directory = directory
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0, *extra: str) -> None:
        """Start it (``extra``: more redis-server arguments, such as ``--replicaof``)."""
        self.process = spawn_redis(self.port, self._directory / f"redis-{self.port}", *extra)
        wait_ping(self.port, timeout)

    def cli(self, *args: str) -> str:
        """A redis-cli command's output (such as ``REPLICAOF NO ONE``)."""
        return _cli(self.port, *args)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


class _Processes:
    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()
        self.processes = []


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a valid port too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535:
            return port


def _node_port(fields: list[str]) -> int:
    """The port of a CLUSTER NODES line (its address field, ip:port@bus)."""
    return int(fields[1].split(":")[1].split("@")[0])


def masters_in(nodes: str) -> list[int]:
    """The ports of the masters not flagged failed in a CLUSTER NODES reply."""
    return [
        _node_port(line.split())
        for line in nodes.splitlines()
        if "master" in line.split()[2] and "fail" not in line.split()[2]
    ]


class RedisCluster(_Processes):
    """A Redis Cluster on loopback, built with redis-cli: ``masters`` masters, each with
    ``replicas`` replicas (promoted ``node_timeout_ms`` after their master stops
    answering). ``full_coverage``: cluster-require-full-coverage (Redis's default,
    yes: every node refuses every slot, CLUSTERDOWN, while a master is flagged failed
    and not yet replaced)."""

    def __init__(
        self,
        directory: Path,
        masters: int = 3,
        replicas: int = 0,
        node_timeout_ms: int = 15000,
        full_coverage: bool = True,
    ) -> None:
        super().__init__()
        self.full_coverage = full_coverage
        self.ports = [_cluster_port() for _ in range(masters * (1 + replicas))]
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self._directory = directory

    def masters(self) -> list[int]:
        """The ports of the nodes that are masters now (as the first live node sees it)."""
        for port in self.ports:
            nodes = _cli(port, "cluster", "nodes")
            if nodes:
                return masters_in(nodes)
        return []

    def agreed_masters(self, timeout: float = 20.0) -> list[int]:
        """The masters, once every live node names the same ones, as many as the
        cluster was built with (a failover under way, or a view not yet gossiped, is
        waited out: a fault scenario must kill a node that is a master everywhere)."""
        count = len(self.ports) // (1 + self.replicas)
        seen: list[list[int]] = []

        def agreed() -> bool:
            views = [_cli(p, "cluster", "nodes") for p in self.ports]
            seen[:] = [sorted(masters_in(v)) for v in views if v]
            return len(seen[0]) == count and all(v == seen[0] for v in seen)

        eventually(agreed, timeout=timeout, what="every node naming the same masters")
        return seen[0]

    def replicas_of(self, port: int) -> list[int]:
        """The ports of the replicas of the master on ``port``, as it sees them."""
        nodes = [line.split() for line in _cli(port, "cluster", "nodes").splitlines()]
        (own,) = [fields[0] for fields in nodes if "myself" in fields[2]]
        return [_node_port(f) for f in nodes if "slave" in f[2] and f[3] == own]

    def cli(self, port: int, *args: str) -> str:
        """redis-cli on one node: its output."""
        return _cli(port, *args)

    def slot_ranges(self, port: int) -> list[tuple[int, int]]:
        """The slot ranges the node on ``port`` serves now (as it sees itself)."""
        for line in _cli(port, "cluster", "nodes").splitlines():
            fields = line.split()
            if "myself" in fields[2]:
                bounds = [f.split("-") for f in fields[8:] if not f.startswith("[")]
                return [(int(b[0]), int(b[-1])) for b in bounds]
        return []

    def kill(self, port: int) -> None:
        """SIGKILL one node."""
        process = self.processes[self.ports.index(port)]
        process.kill()
        process.wait()

    def start(self) -> None:
        for port in self.ports:
            self.processes.append(
                spawn_redis(
                    port,
                    self._directory / f"node-{port}",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(self.node_timeout_ms),
                    "--repl-diskless-sync-delay",
                    "0",
                    "--cluster-require-full-coverage",
                    "yes" if self.full_coverage else "no",
                )
            )
        for port in self.ports:
            wait_ping(port)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            check=True,
            timeout=60,
        )
        eventually(
            lambda: all("cluster_state:ok" in _cli(p, "cluster", "info") for p in self.ports),
            timeout=20,
            what="the cluster ready",
        )
        if self.replicas:  # a replica that never synced is not promoted
            eventually(
                lambda: (
                    sum(
                        "master_link_status:up" in _cli(p, "info", "replication")
                        for p in self.ports
                    )
                    == len(self.ports) - len(self.ports) // (1 + self.replicas)
                ),
                timeout=20,
                what="every replica in sync",
            )


class RedisSentinelSetup(_Processes):
    """A master, a replica and one Sentinel watching them (quorum 1)."""

    MASTER = "rlmaster"

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self._directory = directory
        self.master_port, self.replica_port, self.sentinel_port = (free_port() for _ in "abc")
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.MASTER}"

    def start(self) -> None:
        self.processes.append(spawn_redis(self.master_port, self._directory / "master"))
        wait_ping(self.master_port)
        self.processes.append(
            spawn_redis(
                self.replica_port,
                self._directory / "replica",
                "--replicaof",
                "127.0.0.1",
                str(self.master_port),
            )
        )
        wait_ping(self.replica_port)
        config = self._directory / "sentinel.conf"
        config.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self._directory}\n"
            f"sentinel monitor {self.MASTER} 127.0.0.1 {self.master_port} 1\n"
            f"sentinel down-after-milliseconds {self.MASTER} 1000\n"
            f"sentinel failover-timeout {self.MASTER} 5000\n"
        )
        self.processes.append(
            subprocess.Popen(
                ["redis-server", str(config), "--sentinel"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_ping(self.sentinel_port)

    def kill_master(self) -> None:
        """SIGKILL the first master (the Sentinel promotes the replica)."""
        self.processes[0].kill()
        self.processes[0].wait()

    def master(self) -> int:
        """The port the Sentinel names as master now."""
        reply = _cli(self.sentinel_port, "sentinel", "get-master-addr-by-name", self.MASTER)
        return int(reply.split()[1])

    def failover(self, timeout: float = 30.0) -> None:
        """Ask for a failover once the Sentinel knows the replica (it learns of replicas
        from the master's INFO, every few seconds) and the replica is in sync."""
        deadline = time.monotonic() + timeout
        while True:
            reply = _cli(self.sentinel_port, "sentinel", "failover", self.MASTER)
            if reply.strip() == "OK":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"failover refused: {reply.strip()}")
            time.sleep(0.2)


TEST_CLOCK = "test:clock"
"""The hash a test writes its clock into (fields ``s`` and ``us``), for scripts run
with :func:`script_on_test_clock`."""


def script_on_test_clock(name: str) -> str:
    """A resource script with Redis's TIME replaced by a read of TEST_CLOCK, so that a
    test sets the time it runs at and compares the script with its Python twin."""
    from ratelimit_service.storage.redis_calls import script_text

    source = script_text(name)
    time_call = "local t = call('TIME')"
    assert source.count(time_call) == 1, name
    return source.replace(time_call, f"local t = call('HMGET', '{TEST_CLOCK}', 's', 'us')")


async def set_test_clock(client: Any, now_us: int) -> None:
    """Set TEST_CLOCK to ``now_us`` (microseconds) with an asyncio redis client."""
    await client.hset(TEST_CLOCK, mapping={"s": now_us // 10**6, "us": now_us % 10**6})
