"""Headless Chromium (Debian's ``chromium``) for the status page: the DOM its script
made, or a screenshot. Run as an asyncio child process, so that a service on the same
event loop keeps answering the page's requests meanwhile."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
BUDGET_MS = 5000
"""Virtual time the page gets before it is read: the script's first poll and its
answer (virtual time waits for requests in flight), and a few polls more."""
TIMEOUT = 60.0


def chromium() -> str | None:
    """The Chromium binary on the PATH, if any."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


async def _run(*arguments: str) -> bytes:
    binary = chromium()
    if binary is None:
        raise FileNotFoundError("chromium is not installed")
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        process = await asyncio.create_subprocess_exec(
            binary, *FLAGS, f"--user-data-dir={profile}", *arguments,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(process.communicate(), TIMEOUT)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    if process.returncode != 0:
        tail = err.decode(errors="replace")[-2000:]
        raise RuntimeError(f"chromium exited with {process.returncode}: {tail}")
    return out


async def dump_dom(url: str, budget_ms: int = BUDGET_MS) -> str:
    """The page's DOM once its scripts have run for ``budget_ms`` of virtual time."""
    out = await _run(f"--virtual-time-budget={budget_ms}", "--dump-dom", url)
    return out.decode()


async def screenshot(
    url: str, path: Path, size: tuple[int, int] = (1400, 1800), budget_ms: int = BUDGET_MS
) -> None:
    """A PNG of the page at ``size`` (width, height) once its scripts have run."""
    await _run(
        f"--virtual-time-budget={budget_ms}",
        f"--window-size={size[0]},{size[1]}",
        f"--screenshot={path}",
        url,
    )
    if not path.exists():
        raise RuntimeError(f"chromium wrote no screenshot at {path}")
