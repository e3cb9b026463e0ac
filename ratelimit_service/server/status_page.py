"""The status page on the admin port: ``/status`` for a browser (resources/status.html,
which reads the JSON every 2 s) and ``/status.json`` (engine/status.py's snapshot). With
``--workers`` the supervisor serves the same page, and as its JSON each worker's
snapshot (:func:`workers_json`): the page offers a choice among them."""

from __future__ import annotations

import logging
from importlib import resources

from ratelimit_service.engine.status import StatusBoard
from ratelimit_service.server.http_server import Page, PageResult

log = logging.getLogger(__name__)

PAGE = resources.files("ratelimit_service.resources").joinpath("status.html").read_bytes()
HTML = "text/html; charset=utf-8"
JSON = "application/json"


def status_routes(board: StatusBoard) -> dict[str, Page]:
    """The page and its JSON, for pages()."""

    async def snapshot() -> PageResult:
        try:
            return 200, JSON, await board.json()
        except Exception as exc:  # a bug in the snapshot must not cost the admin port
            log.exception("status snapshot failed")
            return 500, "text/plain", f"status snapshot failed: {exc}\n".encode()

    return {"/status": lambda: (200, HTML, PAGE), "/status.json": snapshot}


def workers_json(snapshots: list[bytes | None]) -> bytes:
    """The workers' snapshots in one document, ``{"workers": [...]}``, in worker order
    (null for a worker that did not answer): each is bounded, so the whole is too."""
    return b'{"workers":[' + b",".join(s or b"null" for s in snapshots) + b"]}"
