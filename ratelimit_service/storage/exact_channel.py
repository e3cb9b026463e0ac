"""The exact batcher's channel to Redis (exact_batcher.Channel): callbacks on the pipelined
connection (redis_pipe), or redis-py (Sentinel), each call through the store's breaker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.redis_calls import ScriptCalls, outcome

REPOLL = 0.001
"""Seconds before a look at a silent Redis reads the socket again (see silent_longer_than)."""


class ExactChannel:
    """exact_window.lua's calls for the batcher, over ``calls``."""

    def __init__(self, calls: ScriptCalls, script: Any) -> None:
        self._calls = calls
        self._script = script
        self._polled = 0.0
        """When silent_longer_than last read the socket (perf_counter)."""

    def send(self, keys: list[str], args: list[Any], deliver: Callable[[Any], None]) -> None:
        calls = self._calls
        if not calls.breaker.allow():
            deliver(StoreUnavailable("redis: circuit open after recent failures"))
            return
        calls.calls += 1
        pipe, script = calls.pipe, self._script
        if pipe is not None and pipe.evalsha_now(script.sha, script.script, keys, args, deliver):
            return
        if pipe is None:  # Sentinel: redis-py, left to finish even past the deadline
            call = asyncio.ensure_future(calls.run_timed(script, keys, args))
        else:  # not connected yet: connect first
            call = asyncio.ensure_future(pipe.evalsha(script.sha, script.script, keys, args))
        call.add_done_callback(lambda done: deliver(outcome(done)))

    def settle(self, reply: Any) -> Any:
        if not isinstance(reply, BaseException):
            self._calls.replied()
            return reply
        if isinstance(reply, StoreUnavailable):  # the circuit was open: nothing was sent
            raise reply
        if isinstance(reply, Exception):  # redis-py's own troubles in a failover too
            raise self._calls.failed(reply) from reply
        raise reply

    def ready(self) -> bool:
        return not self._calls.breaker.open

    def silent_longer_than(self, seconds: float) -> bool:
        """Asked for each request: with the loop behind, Redis looks silent to every call
        of a read while its reply waits on the socket. The socket is read for the first
        (a reply may be waiting; or the silence drops the connection), not again for the
        rest within REPOLL: a read per call would cost most when the loop can least
        afford it."""
        pipe = self._calls.pipe
        if pipe is None or pipe.silent_for() < seconds:  # the common case: one look
            return False
        now = time.perf_counter()
        if now - self._polled >= REPOLL:
            self._polled = now
            self.poll()
        return pipe.silent_for() >= seconds

    def poll(self) -> None:
        """Read the replies on the socket; drop a connection silent too long (the breaker opens)."""
        calls, pipe = self._calls, self._calls.pipe
        if pipe is None:
            return
        pipe.poll()
        silent = pipe.silent_for()
        if silent >= calls.silence:
            reason = f"no byte from redis for {silent:.1f} s with calls outstanding"
            calls.silent(reason)
            pipe.drop(reason)

    def timed_out(self, requests: int) -> None:
        self._calls.timeouts += requests
