"""How long a read's bytes waited in the kernel before the native front door read them
(:class:`ReceiveQueue`, one per plaintext connection).

A call's deadline counts from when its caller sent it. The front door sees a call when
it reads it; :class:`~ratelimit_service.engine.loop_lag.LoopLag` says how long the loop
was held before, but not how long bytes sat in the socket's receive queue while the
loop turned normally and still fell behind (a machine slowed for a while at a high
share of its capacity). Those calls would be decided after their caller gave up: Redis
asked, hits counted, the answer thrown away, and the backlog drained at the full price
of a decision.

So right after each read the connection asks the kernel how many bytes are still
queued (``FIONREAD``, one ioctl per read, not per call) and marks them with the time:
those bytes had arrived by then. When a later read reaches the last of them, the read
is at least as old as that mark: a lower bound on the age of every call in it, as a
receive timestamp would give. A call that already used its deadline there is answered
DEADLINE_EXCEEDED at once (server/native_grpc.py), one with too little time left for
Redis by its failure mode (``exact_late``): neither asks Redis.

TLS connections are not measured: the kernel counts ciphertext, the calls are
plaintext. The marks kept are bounded (MAX_MARKS; past it the newest is dropped,
which only weakens the bound).
"""

from __future__ import annotations

import array
import fcntl
import termios
from collections import deque
from collections.abc import Callable

MAX_MARKS = 64
"""Marks kept per connection: reads behind which bytes were still queued."""


def queued_bytes(fd: int) -> int:
    """Bytes in ``fd``'s receive queue, not read yet (0 when the kernel will not say)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, count, True)
    except OSError:
        return 0
    return count[0]


class ReceiveQueue:
    """See the module docstring. ``queued`` says how many bytes wait to be read."""

    __slots__ = ("_marks", "_queued", "_read")

    def __init__(self, queued: Callable[[], int]) -> None:
        self._queued = queued
        self._read = 0
        """Bytes read so far on this connection."""
        self._marks: deque[tuple[float, int]] = deque()
        """(time, offset): by that time the connection's bytes up to offset had come."""

    def waited(self, now: float, size: int) -> float:
        """For a read of ``size`` bytes at ``now`` (any clock, the same each time): the
        seconds its newest byte at least waited in the kernel (0: nothing says so)."""
        end = self._read + size
        self._read = end
        marks = self._marks
        while marks and marks[0][1] < end:  # bytes of this read may have come after
            marks.popleft()
        waited = 0.0
        if marks:  # the whole read had come by then
            at, offset = marks[0]
            waited = max(0.0, now - at)
            if offset == end:
                marks.popleft()
        behind = self._queued()
        if behind > 0 and len(marks) < MAX_MARKS:
            marks.append((now, end + behind))
        return waited
