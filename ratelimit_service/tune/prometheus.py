"""A small client for Prometheus's HTTP API (``/api/v1/query``, ``/api/v1/query_range``),
on urllib (two GET endpoints and JSON), with timeouts and errors said in one line: the
tuner must stop, touching nothing, when Prometheus cannot be asked.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

MAX_POINTS = 10_000
"""Points per series per query_range call: Prometheus refuses more than 11,000."""


class PrometheusError(Exception):
    """Prometheus could not be reached or answered with an error; the message is one line."""


@dataclass(frozen=True, slots=True)
class Series:
    labels: dict[str, str]
    points: list[tuple[float, float]]
    """(unix time, value), ascending; NaN and infinite values are dropped."""


class PrometheusClient:
    def __init__(self, url: str, timeout: float = 30.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise PrometheusError(f"--prometheus must be an http(s):// URL, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, params: dict[str, str]) -> Any:
        address = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(address, timeout=self.timeout) as answer:
                body = answer.read()
        except urllib.error.HTTPError as exc:
            raise PrometheusError(
                f"Prometheus at {self.url} answered HTTP {exc.code}: {_error_text(exc.read())}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {reason}") from None
        try:
            document = json.loads(body)
        except ValueError:
            raise PrometheusError(
                f"Prometheus at {self.url} answered something that is not JSON: {body[:80]!r}"
            ) from None
        if not isinstance(document, dict) or document.get("status") != "success":
            raise PrometheusError(f"Prometheus at {self.url} answered: {_error_text(body)}")
        return document.get("data")

    def query(self, promql: str, at: float) -> list[Series]:
        """An instant query: vectors give one point per series, range vectors their raw
        samples, scalars one unlabelled series."""
        return _series(self._get("/api/v1/query", {"query": promql, "time": _time(at)}))

    def query_range(self, promql: str, start: float, end: float, step: int) -> list[Series]:
        """A range query from ``start`` to ``end`` every ``step`` seconds, split into calls
        of at most MAX_POINTS points and joined per series."""
        joined: dict[tuple[tuple[str, str], ...], Series] = {}
        chunk = step * (MAX_POINTS - 1)
        at = start
        while at <= end:
            upto = min(end, at + chunk)
            params = {"query": promql, "start": _time(at), "end": _time(upto), "step": str(step)}
            for series in _series(self._get("/api/v1/query_range", params)):
                name = tuple(sorted(series.labels.items()))
                joined.setdefault(name, Series(series.labels, [])).points.extend(series.points)
            at = upto + step
        return list(joined.values())


def _time(at: float) -> str:
    return f"{at:.3f}"


def _series(data: Any) -> list[Series]:
    if not isinstance(data, dict):
        raise PrometheusError("Prometheus answered without data")
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar":
        return [Series({}, _points([result]))]
    if kind not in ("vector", "matrix") or not isinstance(result, list):
        raise PrometheusError(f"Prometheus answered an unexpected result type {kind!r}")
    found = []
    for item in result:
        raw = item.get("values") if "values" in item else [item.get("value")]
        found.append(Series(dict(item.get("metric", {})), _points(raw)))
    return found


def _points(raw: Any) -> list[tuple[float, float]]:
    points = []
    for pair in raw or []:
        value = float(pair[1])
        if math.isfinite(value):
            points.append((float(pair[0]), value))
    return points


def _error_text(body: bytes) -> str:
    """The ``error`` field of Prometheus's JSON error answer, else the body's start, on one line."""
    try:
        document = json.loads(body)
    except ValueError:
        document = None
    if isinstance(document, dict) and document.get("error"):
        text = f"{document.get('errorType', 'error')}: {document['error']}"
    else:
        text = body[:200].decode("utf-8", "replace") or "(empty answer)"
    return " ".join(text.split())
