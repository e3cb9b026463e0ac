"""The one way tests wait: eventually() returns the first truthy look, treats the
ignored errors as not yet, and fails naming what it waited for and the context."""

from __future__ import annotations

import itertools

import pytest

from ratelimit_harness import waiting
from ratelimit_harness.waiting import NotYet, eventually, eventually_async


def test_returns_the_first_truthy_look(monkeypatch) -> None:
    monkeypatch.setattr(waiting, "INTERVAL", 0.001)
    looks = itertools.count()
    assert eventually(lambda: next(looks) >= 3 and "ready") == "ready"


def test_ignored_errors_are_not_yet(monkeypatch) -> None:
    monkeypatch.setattr(waiting, "INTERVAL", 0.001)
    looks = itertools.count()

    def check() -> int:
        if next(looks) < 2:
            raise ConnectionRefusedError
        return 7

    assert eventually(check) == 7
    with pytest.raises(ValueError):
        eventually(lambda: int("x"))  # not ignored: raised at once


def test_fails_with_what_and_the_context(monkeypatch) -> None:
    monkeypatch.setattr(waiting, "INTERVAL", 0.001)
    with pytest.raises(NotYet, match=r"not within 0\.01 s: the thing\nthe log"):
        eventually(lambda: False, timeout=0.01, what="the thing", context=lambda: "the log")


async def test_the_async_form_awaits_coroutines(monkeypatch) -> None:
    monkeypatch.setattr(waiting, "INTERVAL", 0.001)
    looks = itertools.count()

    async def check() -> bool:
        return next(looks) >= 2

    assert await eventually_async(check) is True
    with pytest.raises(NotYet):
        await eventually_async(lambda: None, timeout=0.01)
