"""Logging set-up: human text, or one JSON object per line for log pipelines.

At INFO, the default level, the service logs its start-up, each reload and its
shutdown, and nothing per request; problems are WARNING or ERROR.
"""

from __future__ import annotations

import json
import logging
import time

from ratelimit_service.core.settings_table import default


class JsonFormatter(logging.Formatter):
    """``@timestamp``, ``level``, ``logger``, ``@message``, ``exception``: the Go service's."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "@timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "@message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class LateAnswers(logging.Filter):
    """Drops (and counts) grpc's ERROR for an answer after its call ended (Envoy had answered)."""

    dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        late = type(error).__name__ == "ExecuteBatchError" or "ExecuteBatchError" in str(record.msg)
        if late:
            self.dropped += 1
        return not late


LATE_ANSWERS = LateAnswers()
"""The one filter on grpc's logger (configure_logging installs it)."""


def configure_logging(
    level: str = default("--log-level"), log_format: str = default("--log-format")
) -> None:
    handler = logging.StreamHandler()
    text = logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    handler.setFormatter(JsonFormatter() if log_format == "json" else text)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    if LATE_ANSWERS not in grpc_log.filters:
        grpc_log.addFilter(LATE_ANSWERS)
