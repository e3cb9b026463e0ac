"""Waiting in tests for something to become true, one way: look often, fail after a
bound with what was awaited and what the system said meanwhile. Never a fixed sleep
standing in for a condition."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

_T = TypeVar("_T")

INTERVAL = 0.05
"""Seconds between two looks."""


class NotYet(AssertionError):
    """The awaited condition did not hold within the bound."""


def eventually(
    check: Callable[[], _T],
    *,
    timeout: float = 20.0,
    what: str = "",
    context: Callable[[], str] | None = None,
    ignore: tuple[type[BaseException], ...] = (OSError,),
) -> _T:
    """``check()``'s first truthy result, looking every INTERVAL. An error of a type in
    ``ignore`` (a port not listening yet) counts as not yet. After ``timeout`` seconds
    raise NotYet naming ``what``, with ``context()`` (a log, say) appended."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except ignore:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise NotYet(_message(what or repr(check), timeout, context))
        time.sleep(INTERVAL)


@overload
async def eventually_async(
    check: Callable[[], Awaitable[_T]],
    *,
    timeout: float = ...,
    what: str = ...,
    context: Callable[[], str] | None = ...,
    ignore: tuple[type[BaseException], ...] = ...,
) -> _T: ...


@overload
async def eventually_async(
    check: Callable[[], _T],
    *,
    timeout: float = ...,
    what: str = ...,
    context: Callable[[], str] | None = ...,
    ignore: tuple[type[BaseException], ...] = ...,
) -> _T: ...


async def eventually_async(
    check: Callable[[], Any],
    *,
    timeout: float = 20.0,
    what: str = "",
    context: Callable[[], str] | None = None,
    ignore: tuple[type[BaseException], ...] = (OSError,),
) -> Any:
    """:func:`eventually` on the running event loop: ``check`` may be a coroutine
    function, and the loop keeps running between looks."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
        except ignore:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise NotYet(_message(what or repr(check), timeout, context))
        await asyncio.sleep(INTERVAL)


def stop_process(process: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGTERM, and SIGKILL when ``process`` has not ended within ``timeout`` seconds
    (nothing when it has ended already)."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _message(what: str, timeout: float, context: Callable[[], str] | None) -> str:
    text = f"not within {timeout:g} s: {what}"
    return f"{text}\n{context()}" if context is not None else text
