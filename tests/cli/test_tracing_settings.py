"""Tracing's settings: our flags, the Go service's TRACING_* names, and serve's one-line
error when tracing is asked for without a usable extra."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ratelimit_service.cli.go_env import GoSettingError, read_go_environment
from ratelimit_service.cli.main import main


def test_the_go_tracing_settings_set_our_flags() -> None:
    go = read_go_environment(
        {
            "TRACING_ENABLED": "true",
            "TRACING_SERVICE_NAME": "rl",
            "TRACING_SERVICE_NAMESPACE": "edge",
            "TRACING_SERVICE_INSTANCE_ID": "rl-0",
            "TRACING_EXPORTER_PROTOCOL": "GRPC",
            "TRACING_SAMPLING_RATE": "0.01",
        },
        go_mode=True,
    )
    values = {flag: value.value for flag, value in go.values.items() if "tracing" in flag}
    assert values == {
        "--tracing": "1",
        "--tracing-service-name": "rl",
        "--tracing-service-namespace": "edge",
        "--tracing-service-instance-id": "rl-0",
        "--tracing-protocol": "grpc",
        "--tracing-sampling-rate": "0.01",
    }
    assert go.warnings == []
    off = read_go_environment({"TRACING_ENABLED": "false"}, go_mode=False)
    assert off.values["--tracing"].value == ""


@pytest.mark.parametrize(
    ("name", "value"),
    [("TRACING_EXPORTER_PROTOCOL", "udp"), ("TRACING_SAMPLING_RATE", "2")],
)
def test_bad_go_tracing_values_stop_the_start(name: str, value: str) -> None:
    with pytest.raises(GoSettingError, match=name):
        read_go_environment({name: value}, go_mode=False)


def test_serve_with_tracing_and_no_extra_exits_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "rules.yaml").write_text("domain: d\ndescriptors: []\n")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    code = main(["serve", "--config", str(tmp_path), "--tracing"])
    assert code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("serve: tracing needs the tracing extra")
