"""xDS ``RateLimitConfig`` resources → rule files in the envoyproxy/ratelimit YAML format.

Like the Go service, which maps the proto onto its YAML structs, each resource is loaded
as YAML text by :func:`~ratelimit_service.core.config_loader.load_config`: both paths
accept and reject the same things, with no second validator to keep in step.

The proto has no field for ``value_to_metric``, ``share_threshold`` (as in the Go service)
nor our ``mode``, ``failure_mode`` and ``burst``: rules by xDS take the loader's defaults.

The loader's errors name lines of the generated text, which nobody sees; :func:`explain`
names the descriptor instead (``key=value > key``), as the control plane's operator sent it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from google.protobuf import json_format

from ratelimit_service.config import rls_conf_pb2
from ratelimit_service.core.config_errors import ConfigError
from ratelimit_service.core.config_loader import ConfigFile

TYPE_URL = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig"
FILE_PREFIX = "xds:"


def to_config_file(resource: Any) -> ConfigFile:
    """One ``RateLimitConfig`` message as a rule file, named (in the loader's errors) by the
    resource's name, else its domain."""
    document = {
        "domain": resource.domain,
        "descriptors": [_descriptor(d) for d in resource.descriptors],
    }
    text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=2**31 - 1)
    return ConfigFile(f"{FILE_PREFIX}{resource.name or resource.domain}", text)


def _descriptor(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"key": message.key}
    if message.value:
        out["value"] = message.value
    if message.HasField("rate_limit"):
        out["rate_limit"] = _policy(message.rate_limit)
    if message.rate_limits:
        out["rate_limits"] = [_policy(policy) for policy in message.rate_limits]
    for flag in ("shadow_mode", "detailed_metric", "quota_mode"):
        if getattr(message, flag):
            out[flag] = True
    if message.HasField("metadata"):
        out["metadata"] = json_format.MessageToDict(message.metadata)
    if message.descriptors:
        out["descriptors"] = [_descriptor(d) for d in message.descriptors]
    return out


def _policy(message: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if message.unit != rls_conf_pb2.UNKNOWN:
        out["unit"] = _unit_name(message.unit)
    elif not message.unlimited:
        # Left for the loader to reject as "invalid rate limit unit 'UNKNOWN'", as the
        # Go service does; with `unlimited` an unset unit is the valid case.
        out["unit"] = "UNKNOWN"
    out["requests_per_unit"] = message.requests_per_unit
    if message.unit_multiplier:
        out["unit_multiplier"] = message.unit_multiplier
    if message.unlimited:
        out["unlimited"] = True
    if message.name:
        out["name"] = message.name
    if message.replaces:
        out["replaces"] = [{"name": r.name} for r in message.replaces]
    return out


def _unit_name(number: int) -> str:
    """The enum's name; a number this proto does not know (a newer server) as itself,
    so the loader reports it as an invalid unit."""
    try:
        return str(rls_conf_pb2.RateLimitUnit.Name(number))
    except ValueError:
        return str(number)


@dataclass(frozen=True, slots=True)
class _Span:
    start: int  # 1-based lines, inclusive
    end: int
    path: str


class DescriptorLines:
    """Which descriptor each line of a generated file belongs to."""

    def __init__(self, text: str) -> None:
        self._spans: list[_Span] = []
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError:  # not ours to report; the loader will
            return
        if isinstance(root, yaml.MappingNode):
            self._walk(_get(root, "descriptors"), ())
        self._spans.sort(key=lambda span: span.start)
        self._starts = [span.start for span in self._spans]

    def _walk(self, node: yaml.Node | None, parents: tuple[str, ...]) -> None:
        if not isinstance(node, yaml.SequenceNode):
            return
        for item in node.value:
            if not isinstance(item, yaml.MappingNode):
                continue
            key, value = _get(item, "key"), _get(item, "value")
            label = (str(key.value) if isinstance(key, yaml.ScalarNode) else "") or "(empty key)"
            if isinstance(value, yaml.ScalarNode):
                label += f"={value.value}"
            path = (*parents, label)
            # end_mark is where the next sibling starts (exclusive) in block style.
            end = max(item.start_mark.line + 1, item.end_mark.line)
            self._spans.append(_Span(item.start_mark.line + 1, end, " > ".join(path)))
            self._walk(_get(item, "descriptors"), path)

    def path_at(self, line: int) -> str | None:
        """The innermost descriptor holding ``line`` (the last to start), or None (domain level)."""
        started = self._spans[: bisect.bisect_right(self._starts, line)]
        return next((span.path for span in reversed(started) if line <= span.end), None)


def _get(mapping: yaml.MappingNode, name: str) -> yaml.Node | None:
    pairs: list[tuple[yaml.Node, yaml.Node]] = mapping.value
    for key, value in pairs:
        if isinstance(key, yaml.ScalarNode) and key.value == name:
            return value
    return None


def explain(errors: Sequence[ConfigError], files: Sequence[ConfigFile]) -> list[str]:
    """Each loader error as ``xds:<name>: descriptor <path>: <message>`` (no line numbers:
    they are lines of text the control plane never sent)."""
    lines_by_file = {f.name: f for f in files}
    cache: dict[str, DescriptorLines] = {}
    out: list[str] = []
    for error in errors:
        file = lines_by_file.get(error.file)
        if file is None or error.line is None:
            out.append(f"{error.file}: {error.message}")
            continue
        if error.file not in cache:
            cache[error.file] = DescriptorLines(file.text)
        path = cache[error.file].path_at(error.line)
        where = f"{error.file}: descriptor {path}" if path else error.file
        out.append(f"{where}: {error.message}")
    return out
