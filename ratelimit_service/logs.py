"""Logging set-up: human text, or one JSON object per line for log pipelines.

Nothing is logged per request at INFO; the start-up line (WARNING, so it shows at
the default level) says what was loaded and which store and modes are in use.
"""

from __future__ import annotations

import json
import logging
import time


class JsonFormatter(logging.Formatter):
    """``{"@timestamp", "level", "logger", "@message"}`` plus ``exception`` when there is one
    (field names as envoyproxy/ratelimit's JSON logs)."""

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


def configure_logging(level: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
