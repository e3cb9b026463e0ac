"""storage/exact_channel.py: the batcher's look at a silent Redis."""

from __future__ import annotations

import time

import pytest

from ratelimit_service.storage import exact_channel
from ratelimit_service.storage.exact_channel import ExactChannel


class _Pipe:
    def __init__(self, silent: float) -> None:
        self.silent = silent
        self.polls = 0

    def silent_for(self) -> float:
        return self.silent

    def poll(self) -> None:
        self.polls += 1


class _Calls:
    silence = 60.0

    def __init__(self, pipe: _Pipe) -> None:
        self.pipe = pipe


def test_calls_of_one_read_behind_a_silent_redis_read_its_socket_once() -> None:
    pipe = _Pipe(silent=0.05)
    channel = ExactChannel(_Calls(pipe), script=None)  # type: ignore[arg-type]
    # 200 calls of one read, each with 15 ms left: Redis silent longer than that.
    assert all(channel.silent_longer_than(0.015) for _ in range(200))
    assert pipe.polls == 1
    time.sleep(exact_channel.REPOLL)
    assert channel.silent_longer_than(0.015)
    assert pipe.polls == 2  # looked at again once REPOLL has passed


@pytest.mark.parametrize("silent", [0.0, 0.01])
def test_a_redis_heard_from_lately_is_not_read_at_all(silent: float) -> None:
    pipe = _Pipe(silent=silent)
    channel = ExactChannel(_Calls(pipe), script=None)  # type: ignore[arg-type]
    assert not any(channel.silent_longer_than(0.015) for _ in range(50))
    assert pipe.polls == 0


def test_a_reply_found_on_the_socket_ends_the_silence() -> None:
    pipe = _Pipe(silent=0.05)

    def poll() -> None:
        pipe.polls += 1
        pipe.silent = 0.0  # the reply was waiting: read now

    pipe.poll = poll  # type: ignore[method-assign]
    channel = ExactChannel(_Calls(pipe), script=None)  # type: ignore[arg-type]
    assert not channel.silent_longer_than(0.015)
    assert pipe.polls == 1
