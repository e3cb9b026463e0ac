"""``ratelimit-service tune`` against a real Prometheus holding two weeks and a day of
synthetic history (backfilled with promtool, in our metric names, two replicas),
whose peaks are known, so every proposal is asserted exactly."""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from ratelimit_harness.prometheus import Prometheus, prometheus_missing
from ratelimit_harness.redis import free_port
from ratelimit_service.cli.main import main
from ratelimit_service.core.config_loader import UNIT_NAMES

pytestmark = pytest.mark.slow  # starts processes

STEP = 300  # seconds between synthetic samples: the "scrape interval" of the history
DAY = 86400
END = (int(time.time()) // 3600) * 3600 - 3600  # the window's end, on the step grid
START = END - 15 * DAY  # history begins a day before the 14-day window
PEAK = START + 3 * DAY  # an hour of peak traffic, inside the window
BURST = START + 9 * DAY  # one five-minute burst
METRIC = "ratelimit_service_rate_limit_{}_total"

RULES = """\
# Rules of the shop, tuned from traffic.
domain: shop
descriptors:
  # Search: per second, probabilistic.
  - key: api
    value: search
    rate_limit:
      unit: second
      requests_per_unit: 50   # first guess
  - key: api
    value: write
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 1000}
  - key: api
    value: browse
    rate_limit:
      unit: second
      requests_per_unit: 1000
  # Watched in shadow, per tenant.
  - key: tenant
    detailed_metric: true
    shadow_mode: true
    rate_limit:
      unit: second
      requests_per_unit: 20
  - key: api
    value: export
    shadow_mode: true
    rate_limit:
      unit: second
      requests_per_unit: 10
  - key: api
    value: quiet
    rate_limit:
      unit: second
      requests_per_unit: 7
  - key: api
    value: rare
    rate_limit:
      unit: second
      requests_per_unit: 9
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10
  - key: api
    value: blocked
    rate_limit:
      unit: second
      requests_per_unit: 0
"""


def _series(
    metric: str, key: str, instance: str, per_second: Callable[[int], float], since: int = START
) -> list[str]:
    """One counter's samples every STEP from ``since`` to END; ``per_second(t)`` is its
    rate over the STEP that ends at t."""
    lines, value = [], 0
    for t in range(since, END + 1, STEP):
        value += round(per_second(t) * STEP)
        lines.append(f'{METRIC.format(metric)}{{instance="{instance}",key="{key}"}} {value} {t}')
    return lines


def _during(start: int, seconds: int, inside: float, outside: float) -> Callable[[int], float]:
    return lambda t: inside if start < t <= start + seconds else outside


def history() -> str:
    """The synthetic history, in OpenMetrics. Fleet demand (both replicas):

    - shop.api_search: 50/s; 100/s for an hour (of which 50/s denied); a 5-minute burst
      of 400/s, which 10-minute rate windows see as two points of 225/s;
    - shop.api_write: 600/min; 1200/min for two hours, 1000 hits denied per 5 min;
    - shop.api_browse: 40/s; shop.api_export: 2/s, nothing denied (shadow);
    - shop.tenant_*: acme 10/s, 30/s for an hour (10/s over its limit of 20);
      globex 2/s with 100 would-be denials once; initech 1/s;
    - shop.api_rare: only in the last 25 minutes; shop.remote_address: 5/s.
    """
    families: dict[str, list[str]] = {m: [] for m in ("total_hits", "over_limit", "shadow_mode")}
    hits, over = families["total_hits"], families["over_limit"]

    def search(share: float) -> Callable[[int], float]:
        peak_hour = _during(PEAK, 3600, 100, 50)
        return lambda t: (400 if BURST < t <= BURST + STEP else peak_hour(t)) * share

    hits += _series("total_hits", "shop.api_search", "a", search(0.6))
    hits += _series("total_hits", "shop.api_search", "b", search(0.4))
    over += _series("over_limit", "shop.api_search", "a", _during(PEAK, 3600, 30, 0))
    over += _series("over_limit", "shop.api_search", "b", _during(PEAK, 3600, 20, 0))
    for instance in ("a", "b"):
        hits += _series("total_hits", "shop.api_write", instance, _during(PEAK, 7200, 10, 5))
        over += _series(
            "over_limit", "shop.api_write", instance, _during(PEAK, 7200, 500 / STEP, 0)
        )
        hits += _series("total_hits", "shop.tenant_acme", instance, _during(PEAK, 3600, 15, 5))
        for metric in ("over_limit", "shadow_mode"):
            families[metric] += _series(
                metric, "shop.tenant_acme", instance, _during(PEAK, 3600, 5, 0)
            )
    hits += _series("total_hits", "shop.api_browse", "a", lambda t: 40)
    hits += _series("total_hits", "shop.api_export", "b", lambda t: 2)
    hits += _series("total_hits", "shop.tenant_globex", "a", lambda t: 2)
    for metric in ("over_limit", "shadow_mode"):
        families[metric] += _series(
            metric, "shop.tenant_globex", "a", _during(BURST, STEP, 100 / STEP, 0)
        )
    hits += _series("total_hits", "shop.tenant_initech", "b", lambda t: 1)
    hits += _series("total_hits", "shop.api_rare", "a", lambda t: 3, since=END - 1500)
    hits += _series("total_hits", "shop.remote_address", "a", lambda t: 5)
    text = []
    for metric, lines in families.items():
        text.append(f"# TYPE {METRIC.format(metric)[: -len('_total')]} counter")
        text += lines
    return "\n".join([*text, "# EOF"]) + "\n"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Without Prometheus the tests skip locally and fail under CI (.ci/run installs it)."""
    if (missing := prometheus_missing()) is not None:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    server = Prometheus(tmp_path_factory.mktemp("prometheus"))
    server.backfill(history())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "config"
    directory.mkdir()
    (directory / "shop.yaml").write_text(RULES)
    return directory


def tune(
    capsys: pytest.CaptureFixture[str], url: str, config: Path, *flags: str
) -> tuple[int, str, str]:
    code = main(["tune", "--prometheus", url, "--config", str(config), "--end", str(END), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> dict[str, list[str]]:
    """The table's rows by rule, cells split on runs of two or more spaces."""
    import re

    table = {}
    for line in out.splitlines()[1:]:
        if not line.startswith("shop."):
            break
        cells = re.split(r"\s{2,}", line)
        table[cells[0]] = cells[1:]
    return table


def test_the_report_proposes_exact_limits_from_the_peaks(
    prometheus: Prometheus, rules_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = tune(capsys, prometheus.url, rules_dir)
    assert (code, err) == (0, "")
    table = rows(out)
    assert out.splitlines()[0].split() == [
        "rule", "mode", "current", "peak", "(max)", "proposed", "denied", "note",
    ]  # fmt: skip
    assert table == {
        "shop.api_search": ["probabilistic", "50/second", "225", "293", "0.296 %"],
        "shop.api_write": ["exact", "1000/minute", "1200", "1560", "0.197 %"],
        "shop.api_browse": ["probabilistic", "1000/second", "40", "1000", "0.000 %", "unchanged"],
        "shop.tenant": ["probabilistic shadow", "20/second", "30", "39", "0.229 % (would)"],
        "shop.api_export": ["probabilistic shadow", "10/second", "2", "10", "0.000 % (would)",
                            "unchanged"],
        "shop.api_quiet": ["probabilistic", "7/second", "-", "-", "-", "no data"],
        "shop.api_rare": ["probabilistic", "9/second", "-", "-", "0.000 %",
                          "too little data (5 of 60 samples)"],
        "shop.remote_address": ["probabilistic", "10/second", "-", "-", "0.000 %",
                                "one counter per value, but its stats add up every value: set"
                                " detailed_metric: true to tune it"],
        "shop.api_blocked": ["probabilistic", "0/second", "-", "-", "-",
                             "limit 0 denies everything on purpose"],
    }  # fmt: skip
    assert (
        "resolution: per-second demand from rates over 10 min windows every 5 min (scrape"
        " interval 5 min); bursts shorter than 10 min are averaged out: shop.api_search,"
        " shop.api_browse, shop.tenant, shop.api_export\n" in out
    )
    assert (
        "resolution: per-minute demand from rates over 10 min windows every 5 min (scrape"
        " interval 5 min); bursts shorter than 10 min are averaged out: shop.api_write\n" in out
    )
    # Shadow rules: how often and for whom.
    assert (
        "shadow shop.tenant: the written limit 20/second would have denied 36100 of 15796800"
        " hits over 14d (0.229 %)\n  most denied: shop.tenant_acme (36000),"
        " shop.tenant_globex (100)\n" in out
    )
    assert "shadow shop.api_export: the written limit 10/second would have denied 0 of" in out
    # The diff touches the three numbers only; the file is untouched without --write.
    assert out.endswith(
        textwrap.dedent(f"""\
        --- {rules_dir}/shop.yaml
        +++ {rules_dir}/shop.yaml
        @@ -6,11 +6,11 @@
             value: search
             rate_limit:
               unit: second
        -      requests_per_unit: 50   # first guess
        +      requests_per_unit: 293   # first guess
           - key: api
             value: write
             mode: exact
        -    rate_limit: {{unit: minute, requests_per_unit: 1000}}
        +    rate_limit: {{unit: minute, requests_per_unit: 1560}}
           - key: api
             value: browse
             rate_limit:
        @@ -22,7 +22,7 @@
             shadow_mode: true
             rate_limit:
               unit: second
        -      requests_per_unit: 20
        +      requests_per_unit: 39
           - key: api
             value: export
             shadow_mode: true
        """)
    )
    assert (rules_dir / "shop.yaml").read_text() == RULES


def test_a_quantile_ignores_a_short_burst_and_lowering_needs_allow_lower(
    prometheus: Prometheus, rules_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = tune(capsys, prometheus.url, rules_dir, "--stat", "p99.9", "--headroom", "0.5")
    table = rows(out)
    assert code == 0
    assert "peak (p99.9)" in out.splitlines()[0]
    # 4032 points: 2 at 225/s (the burst), 11 at 100/s, 2 at 75/s; rank 4028 is 100.
    assert table["shop.api_search"][2:4] == ["100", "150"]
    assert table["shop.api_browse"][2:4] == ["40", "1000"]
    _, out, _ = tune(capsys, prometheus.url, rules_dir, "--allow-lower")
    assert rows(out)["shop.api_browse"][2:4] == ["40", "52"]
    assert rows(out)["shop.api_export"][2:4] == ["2", "3"]
    _, out, _ = tune(capsys, prometheus.url, rules_dir, "--allow-lower", "--floor", "60")
    assert rows(out)["shop.api_browse"][2:4] == ["40", "60"]


def test_write_and_promote_edit_the_file_in_place(
    prometheus: Prometheus, rules_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = tune(
        capsys, prometheus.url, rules_dir, "--promote", "--write", "--min-samples", "4"
    )
    assert (code, err) == (0, "")
    # export would have denied nothing: enforced; tenant 0.229 % is not below 0.1 %;
    # rare has 5 samples now, enough: 3/s, at its current 9.
    assert rows(out)["shop.api_export"][3] == "10 enforce"
    assert rows(out)["shop.api_rare"][2:4] == ["3", "9"]
    assert "  promoted: shadow_mode off (below 0.1 %)\n" in out
    assert "  not promoted: not below 0.1 %\n" in out
    assert f"wrote {rules_dir}/shop.yaml\n" in out
    expected = (
        RULES.replace(
            "requests_per_unit: 50   # first guess", "requests_per_unit: 293   # first guess"
        )
        .replace("requests_per_unit: 1000}", "requests_per_unit: 1560}")
        .replace("requests_per_unit: 20\n", "requests_per_unit: 39\n")
        .replace("export\n    shadow_mode: true", "export\n    shadow_mode: false")
    )
    assert (rules_dir / "shop.yaml").read_text() == expected
    assert [p.name for p in rules_dir.iterdir()] == ["shop.yaml"]  # no temporary left
    # Run again on the written file: the proposals are where the limits now are.
    _, out, _ = tune(capsys, prometheus.url, rules_dir, "--promote-below", "0.5", "--promote")
    assert rows(out)["shop.tenant"][3] == "39 enforce"
    assert "-    shadow_mode: true\n+    shadow_mode: false\n" in out


def test_plots_one_png_per_rule_and_an_index(
    prometheus: Prometheus, rules_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = tune(capsys, prometheus.url, rules_dir, "--plot", str(tmp_path / "plots"))
    assert code == 0
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == [
        "index.html", "shop.api_browse.png", "shop.api_export.png", "shop.api_rare.png",
        "shop.api_search.png", "shop.api_write.png", "shop.tenant.png",
    ]  # fmt: skip
    for name in names[1:]:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    index = (tmp_path / "plots" / "index.html").read_text()
    assert index.count("<img ") == 6 and "<pre>rule " in index
    assert f"plots: {tmp_path / 'plots' / 'index.html'}\n" in out


def test_a_config_that_does_not_load_gives_the_loaders_message(
    prometheus: Prometheus, rules_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (rules_dir / "shop.yaml").write_text(RULES.replace("unit: minute", "unit: fortnight"))
    code, out, err = tune(capsys, prometheus.url, rules_dir)
    assert (code, out) == (1, "")
    where = f"{rules_dir}/shop.yaml:13"
    assert err == f"{where}: invalid rate limit unit 'fortnight'; valid units: {UNIT_NAMES}\n"


class _Failing(BaseHTTPRequestHandler):
    status = 400
    body = b""

    def do_GET(self) -> None:
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (400, json.dumps({"status": "error", "errorType": "bad_data", "error": "parse\nerror"}),
         "answered HTTP 400: bad_data: parse error"),
        (503, "Service Unavailable", "answered HTTP 503: Service Unavailable"),
        (200, "<html>not the API</html>", "answered something that is not JSON: b'<html>not"),
    ],
)  # fmt: skip
def test_prometheus_answering_errors_stops_with_one_line_and_touches_nothing(
    rules_dir: Path, capsys: pytest.CaptureFixture[str], status: int, body: str, message: str
) -> None:
    handler = type("Handler", (_Failing,), {"status": status, "body": body.encode()})
    server = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        code, out, err = tune(capsys, url, rules_dir, "--write")
    finally:
        server.shutdown()
        server.server_close()
    assert (code, out) == (1, "")
    assert err.startswith(f"tune: Prometheus at {url} {message}") and err.count("\n") == 1
    assert (rules_dir / "shop.yaml").read_text() == RULES


def test_prometheus_unreachable_stops_with_one_line(
    rules_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    port = free_port()
    code, out, err = tune(
        capsys, f"http://127.0.0.1:{port}", rules_dir, "--write", "--plot", str(tmp_path / "p")
    )
    assert (code, out) == (1, "")
    refused = "[Errno 111] Connection refused"
    assert err == f"tune: cannot reach Prometheus at http://127.0.0.1:{port}: {refused}\n"
    assert (rules_dir / "shop.yaml").read_text() == RULES
    assert not (tmp_path / "p").exists()


def test_promtool_is_beside_prometheus() -> None:
    """The Debian package that .ci/run installs brings both."""
    if prometheus_missing() is None:
        assert shutil.which("promtool") is not None


def test_plot_without_matplotlib_says_so_before_asking_prometheus(
    rules_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = tune(
        capsys, f"http://127.0.0.1:{free_port()}", rules_dir, "--plot", str(tmp_path / "p")
    )
    assert (code, out) == (1, "")
    assert err == "tune: --plot needs matplotlib: pip install matplotlib (or the test extra)\n"
