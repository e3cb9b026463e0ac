"""Live reload: poll the rule files, validate a change, swap it in atomically.

Polling contents (once a second by default) rather than inotify works the same for
plain files, directories and Kubernetes ConfigMap volumes, whose updates are
symlink swaps that file watchers often miss. A change that does not load leaves the
running config in place; every problem is logged as ``<file>:<line>: <message>``
and counted in ``config_load_error``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from ratelimit_service.config.files import config_paths
from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.config_model import RateLimitConfig
from ratelimit_service.core.settings_table import default
from ratelimit_service.engine.background import BackgroundTask
from ratelimit_service.engine.stats import Stats

log = logging.getLogger(__name__)


def fingerprint(path: str | Path) -> str:
    """A digest of which files the config path names and what they hold."""
    digest = hashlib.sha256()
    try:
        files = config_paths(Path(path))
    except ConfigLoadError:
        return "missing"
    for file in files:
        digest.update(str(file).encode() + b"\0")
        try:
            digest.update(file.read_bytes())
        except OSError:
            digest.update(b"<unreadable>")
        digest.update(b"\0")
    return digest.hexdigest()


class ConfigWatcher:
    def __init__(
        self,
        path: str | Path,
        load: Callable[[], RateLimitConfig],
        install: Callable[[RateLimitConfig], None],
        stats: Stats,
        interval: float = default("--watch-interval"),
    ) -> None:
        self.path = path
        self._load = load
        self._install = install
        self._stats = stats
        self.interval = interval
        self._seen = fingerprint(path)
        self._background = BackgroundTask("config-watcher", self.run)

    def reload(self) -> bool:
        """Load the files now; install them if they are valid. True when installed."""
        self._seen = fingerprint(self.path)
        try:
            config = self._load()
        except ConfigLoadError as exc:
            self._stats.config_load_error += 1
            for error in exc.errors:
                log.error("config not reloaded: %s", error)
            return False
        self._install(config)
        self._stats.config_load_success += 1
        log.info("config reloaded: domains=%s", ",".join(sorted(config.domains)) or "(none)")
        return True

    def check(self) -> None:
        """Reload if the files changed since the last look."""
        if fingerprint(self.path) != self._seen:
            self.reload()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.check()
            except Exception:  # the watcher must outlive any one bad look at the files
                log.exception("config check failed")

    def start(self) -> None:
        self._background.start()

    async def stop(self) -> None:
        await self._background.stop()
