"""The status page's screenshot, docs/img/status_page.png: a service on Redis with the
example rules (config/), RLS calls at 300 a second over a few clients, tenants and
paths (some denied, some in shadow), 20 simulated RLQS Envoys reporting on two tenants,
and headless Chromium's screenshot of /status once the rates cover a few seconds (in
128 colours when Pillow is installed, as matplotlib brings it with the bench extra: a
third of the bytes).

    python bench/status_screenshot.py [--out docs/img/status_page.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import tempfile
import urllib.request
from pathlib import Path

import grpc

from ratelimit_harness.browser import chromium, screenshot
from ratelimit_harness.fleet import SHOULD_RATE_LIMIT, redis_server, service_fleet
from ratelimit_harness.rlqs_sim import SimEnvoy, StreamingEnvoy
from ratelimit_service.cli.client import build_request

REPO = Path(__file__).resolve().parent.parent
CALLS = [
    *([f"remote_address=10.0.0.{n}"] for n in range(1, 9)),
    ["remote_address=10.0.0.9", "tenant=acme,path=/api/write/1"],  # exact 5/s: denied
    ["tenant=globex"],
    ["tenant=premium"],
    ["tenant=blocked"],  # a limit of 0: always denied
    ["path=/api/search/q"],  # shadow 20/s: would deny, answers OK
    ["path=/healthz"],
]
RATE = 300.0
MEASURE_AFTER = 4.0
"""Seconds of load before the first snapshot (the sample rates are measured from)."""
SHOOT_AFTER = 10.0


async def load(port: int, seconds: float) -> None:
    """Open-loop calls at RATE a second, going round CALLS."""
    requests = [build_request("edge", c, 0).SerializeToString() for c in CALLS]
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[object]] = set()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(SHOULD_RATE_LIMIT)
        start = loop.time()
        for n, request in zip(range(int(RATE * seconds)), itertools.cycle(requests)):
            await asyncio.sleep(max(0.0, start + n / RATE - loop.time()))
            task = asyncio.ensure_future(call(request, timeout=1.0))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending, return_exceptions=True)


def envoys(address: str) -> list[StreamingEnvoy]:
    """20 simulated Envoys, offering 2 to 21 calls a second, on two tenants."""
    return [
        StreamingEnvoy(
            SimEnvoy(f"envoy-{n:02d}", 2.0 + n),
            [address],
            "edge",
            {"tenant": "acme" if n % 3 else "globex"},
            every=1.0,
        )
        for n in range(20)
    ]


async def shoot(out: Path) -> None:
    with (
        tempfile.TemporaryDirectory() as tmp,
        redis_server(Path(tmp)) as redis,
        service_fleet(1, REPO / "config", redis.url) as (node,),
    ):
        fleet = envoys(f"127.0.0.1:{node.grpc_port}")
        for envoy in fleet:
            envoy.start()
        calls = asyncio.ensure_future(load(node.grpc_port, SHOOT_AFTER + 5.0))
        try:
            await asyncio.sleep(MEASURE_AFTER)
            url = f"http://127.0.0.1:{node.admin_port}/status"
            await asyncio.to_thread(lambda: urllib.request.urlopen(url + ".json").read())
            await asyncio.sleep(SHOOT_AFTER - MEASURE_AFTER)
            await screenshot(url, out, size=(1400, 2300))
            shrink(out)
        finally:
            calls.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await calls
            for envoy in fleet:
                await envoy.stop()


def shrink(path: Path) -> None:
    """The PNG in 128 colours, if Pillow is there (text and flat colours lose nothing)."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=128, method=Image.Quantize.FASTOCTREE)
    small.save(path, optimize=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "status_page.png")
    args = parser.parse_args()
    if chromium() is None:
        print("chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 2
    asyncio.run(shoot(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
