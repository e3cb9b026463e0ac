"""server/receive_queue.py: a lower bound on how long a read's bytes waited in the
kernel, from the bytes still queued at earlier reads (marks), on a set clock; and the
kernel's count of queued bytes on real sockets."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from ratelimit_service.server.receive_queue import MAX_MARKS, ReceiveQueue, queued_bytes


class Queued:
    """What the kernel says is still queued at each read, as the test sets it."""

    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


def test_bytes_queued_at_a_read_are_at_least_as_old_as_it_when_read() -> None:
    queued = Queued()
    receive = ReceiveQueue(queued)
    queued.value = 500  # after the first read, 500 more bytes were there already
    assert receive.waited(10.0, 100) == 0.0  # nothing said about the first read
    queued.value = 0
    assert receive.waited(10.030, 300) == pytest.approx(0.030)  # bytes 100-400: by 10.0
    assert receive.waited(10.050, 200) == pytest.approx(0.050)  # 400-600: the mark's end
    assert receive.waited(10.060, 100) == 0.0  # past every mark: nothing known


def test_a_read_past_a_mark_is_bounded_by_the_mark_that_covers_its_newest_byte() -> None:
    queued = Queued()
    receive = ReceiveQueue(queued)
    queued.value = 100
    receive.waited(1.0, 100)  # mark: by 1.0, bytes up to 200 had come
    queued.value = 300
    receive.waited(1.010, 50)  # mark: by 1.010, bytes up to 450
    queued.value = 0
    # Bytes 150-300: byte 299 came after the first mark's end, by the second's time.
    assert receive.waited(1.040, 150) == pytest.approx(0.030)
    # A read past the last mark says nothing about its newest byte.
    assert receive.waited(1.050, 500) == 0.0


def test_marks_are_bounded() -> None:
    queued = Queued()
    queued.value = 10**6
    receive = ReceiveQueue(queued)
    for step in range(MAX_MARKS * 3):
        receive.waited(step * 0.001, 1)
    assert len(receive._marks) == MAX_MARKS


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            yield client, accepted


def test_the_kernel_counts_what_waits_on_a_tcp_socket(
    tcp_pair: tuple[socket.socket, socket.socket],
) -> None:
    client, accepted = tcp_pair
    assert queued_bytes(accepted.fileno()) == 0
    client.sendall(b"x" * 1000)
    accepted.settimeout(5)
    first = accepted.recv(400, socket.MSG_PEEK)  # waits until the bytes are there
    assert first
    until = time.monotonic() + 5
    while queued_bytes(accepted.fileno()) < 1000 and time.monotonic() < until:
        pass  # loopback: the rest follows at once
    accepted.recv(400)
    assert queued_bytes(accepted.fileno()) == 600


def test_the_kernel_counts_what_waits_on_a_unix_socket() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"y" * 300)
        assert queued_bytes(right.fileno()) == 300
        right.recv(100)
        assert queued_bytes(right.fileno()) == 200


def test_a_closed_descriptor_says_nothing_is_queued() -> None:
    sock = socket.socket()
    fd = sock.fileno()
    sock.close()
    assert queued_bytes(fd) == 0
