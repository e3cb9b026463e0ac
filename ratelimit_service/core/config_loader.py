"""Turn envoyproxy/ratelimit YAML files into a :class:`RateLimitConfig`.

The format is the Go service's, unchanged, plus keys of ours (docs/configuration.md). We
walk PyYAML's node graph rather than plain Python values so every error can name its
line, and keep going after an error so that ``check-config`` reports everything at once.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, TypeVar

import yaml

from ratelimit_service.core.calendar import CALENDAR_UNITS, UnknownTimeZone, time_zone
from ratelimit_service.core.config_errors import ConfigError, ConfigLoadError
from ratelimit_service.core.config_model import (
    MAX_OVER_LIMIT_BODY,
    DescriptorNode,
    DomainConfig,
    FailureMode,
    Mode,
    NodeChildren,
    OverLimitAnswer,
    RateLimit,
    RateLimitConfig,
    UsageSource,
    WildcardPattern,
    list_label,
)
from ratelimit_service.core.settings_table import default
from ratelimit_service.core.units import UNIT_SECONDS, Unit, parse_unit

UINT32_MAX = 2**32 - 1
_E = TypeVar("_E", bound=Enum)

DOMAIN_KEYS = frozenset({"domain", "descriptors", "mode", "failure_mode"})
DESCRIPTOR_KEYS = frozenset(
    {"key", "value", "rate_limit", "descriptors", "shadow_mode", "quota_mode", "metadata"}
    | {"detailed_metric", "value_to_metric", "share_threshold"}
    | {"rate_limits", "over_limit", "usage", "mode", "failure_mode"}  # ours
)
RATE_LIMIT_KEYS = frozenset(
    {"unit", "requests_per_unit", "unlimited", "name", "replaces"}
    | {"unit_multiplier", "burst", "calendar"}  # ours
)
REPLACES_KEYS = frozenset({"name"})
OVER_LIMIT_KEYS = frozenset({"body", "content_type"})
USAGE_KEYS = frozenset({"from_header", "from_metadata"})
METADATA_KEYS = frozenset({"namespace", "key"})
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")
"""An HTTP header name as Envoy's formatter reads it: lower case token characters."""
_CONTENT_TYPE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+/[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*;[ -~]*)?")
"""type/subtype, optionally followed by parameters: printable ASCII, no line breaks."""


@dataclass(frozen=True, slots=True)
class ConfigFile:
    """A file's display name (used in every error) and its text."""

    name: str
    text: str


@dataclass(frozen=True, slots=True)
class _RuleFlags:
    """Descriptor-level settings that end up on the descriptor's RateLimit."""

    shadow_mode: bool
    quota_mode: bool
    detailed_metric: bool
    metadata: dict[str, Any] | None
    over_limit: OverLimitAnswer | None
    usage: UsageSource | None


@dataclass(frozen=True, slots=True)
class _Inherited:
    mode: Mode
    failure_mode: FailureMode


_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's loader where PyYAML was built with it: several times faster on large rule
files, and its nodes carry the same line marks."""


def _compose(text: str) -> list[yaml.Node]:
    """The documents of ``text``. A file that does not parse is parsed again by
    PyYAML's own loader, whose errors say more (and are the ones the docs show)."""
    try:
        return list(yaml.compose_all(text, Loader=_FAST_LOADER))
    except yaml.YAMLError:
        if _FAST_LOADER is yaml.SafeLoader:
            raise
    return list(yaml.compose_all(text, Loader=yaml.SafeLoader))


class _FileLoader:
    """Loads one file; errors accumulate in ``self.errors``."""

    def __init__(self, file: ConfigFile, inherited: _Inherited) -> None:
        self.file = file
        self.errors: list[ConfigError] = []
        self._constructor = yaml.constructor.SafeConstructor()
        self._default = inherited
        self.domain_line: int | None = None

    def error(self, node: yaml.Node | None, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else None
        self.errors.append(ConfigError(self.file.name, line, message))

    # -- YAML plumbing ---------------------------------------------------------------

    def parse(self) -> yaml.Node | None:
        try:
            documents = _compose(self.file.text)
        except yaml.MarkedYAMLError as exc:
            self.errors.append(_syntax_error(self.file.name, exc))
            return None
        except yaml.YAMLError as exc:
            self.error(None, f"error loading config file: {exc}")
            return None
        if len(documents) > 1:
            self.error(documents[1], "config file must hold one YAML document, found several")
            return None
        return documents[0] if documents else None

    def mapping(self, node: yaml.Node, allowed: frozenset[str]) -> dict[str, yaml.Node] | None:
        """Check a mapping's keys (string, known, not repeated) and index it by key."""
        if not isinstance(node, yaml.MappingNode):
            self.error(node, f"expected a mapping, found {_describe(node)}")
            return None
        result: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node)
            if not isinstance(key, str):
                self.error(key_node, f"config error, key is not of type string: {key_node.value}")
            elif key not in allowed:
                self.error(key_node, f"config error, unknown key '{key}'{_suggest(key, allowed)}")
            elif key in result:
                self.error(key_node, f"config error, duplicate key '{key}'")
            else:
                result[key] = value_node
        return result

    def scalar(self, node: yaml.Node) -> Any:
        if isinstance(node, yaml.ScalarNode):
            return self._constructor.construct_object(node, deep=True)
        return node

    def empty(self, node: yaml.Node) -> bool:
        """A null scalar (``key:`` with nothing after it)."""
        return isinstance(node, yaml.ScalarNode) and self.scalar(node) is None

    def text(self, node: yaml.Node | None, field: str) -> str | None:
        """A string field; ints and bools are accepted as their YAML text, like the Go loader."""
        if node is None or (value := self.scalar(node)) is None:
            return None
        if isinstance(node, yaml.ScalarNode) and isinstance(value, str | int | bool):
            return str(node.value)
        self.error(node, f"'{field}' must be a string, found {_describe(node)}")
        return None

    def flag(self, node: yaml.Node | None, field: str) -> bool:
        if node is None or (value := self.scalar(node)) is None:
            return False
        if not isinstance(value, bool):
            self.error(node, f"'{field}' must be true or false, found {_describe(node)}")
            return False
        return value

    def items(self, node: yaml.Node | None, field: str) -> list[yaml.Node]:
        """A list field's items: none when it is absent or empty, or not a list (an error)."""
        if node is None or self.empty(node):
            return []
        if not isinstance(node, yaml.SequenceNode):
            self.error(node, f"'{field}' must be a list, found {_describe(node)}")
            return []
        return list(node.value)

    # -- the format ------------------------------------------------------------------

    def load(self) -> DomainConfig | None:
        document = self.parse()
        if self.errors:
            return None
        if document is None or self.empty(document):
            self.error(None, "config file cannot have empty domain")
            return None
        if (fields := self.mapping(document, DOMAIN_KEYS)) is None:
            return None
        domain = self.text(fields.get("domain"), "domain")
        if "domain" in fields:
            self.domain_line = fields["domain"].start_mark.line + 1
        if not domain:
            self.error(fields.get("domain", document), "config file cannot have empty domain")
            domain = ""
        inherited = self.inherited(fields, self._default)
        root = NodeChildren()
        self.descriptors(fields.get("descriptors"), root, domain, inherited)
        return DomainConfig(name=domain, root=root, source=self.file.name)

    def inherited(self, fields: dict[str, yaml.Node], parent: _Inherited) -> _Inherited:
        mode = self.choice(fields, "mode", Mode, "exact or probabilistic")
        failure_mode = self.choice(fields, "failure_mode", FailureMode, "open or closed")
        return _Inherited(mode or parent.mode, failure_mode or parent.failure_mode)

    def choice(
        self, fields: dict[str, yaml.Node], field: str, kind: type[_E], choices: str
    ) -> _E | None:
        """``field``'s member of ``kind`` (any case); None when unset or after an error."""
        text = self.text(fields.get(field), field)
        if text is None:
            return None
        try:
            return kind(text.lower())
        except ValueError:
            self.error(fields[field], f"invalid {field} '{text}' ({choices})")
            return None

    def descriptors(
        self, node: yaml.Node | None, into: NodeChildren, path: str, inherited: _Inherited
    ) -> None:
        for item in self.items(node, "descriptors"):
            if not isinstance(item, yaml.MappingNode):
                self.error(
                    item,
                    f"config error, yaml file contains list of type other than map: {_show(item)}",
                )
                continue
            self.descriptor(item, into, path, inherited)

    def descriptor(
        self, node: yaml.MappingNode, into: NodeChildren, path: str, parent: _Inherited
    ) -> None:
        if (fields := self.mapping(node, DESCRIPTOR_KEYS)) is None:
            return
        key = self.text(fields.get("key"), "key")
        if not key:
            self.error(fields.get("key", node), "descriptor has empty key")
            return
        value = self.text(fields.get("value"), "value") or None
        element = key if value is None else f"{key}_{value}"
        config_path = f"{path}.{element}"
        inherited = self.inherited(fields, parent)
        share_threshold = self.flag(fields.get("share_threshold"), "share_threshold")
        is_wildcard = value is not None and "*" in value
        if share_threshold and not is_wildcard:
            self.error(
                fields["share_threshold"],
                "share_threshold can only be used with wildcard values (containing '*'), "
                f"but found key '{element}'",
            )
        flags = self.rule_flags(fields)
        if "rate_limit" in fields and "rate_limits" in fields:
            self.error(
                fields["rate_limits"],
                "a descriptor has rate_limit or rate_limits, not both: put every limit in"
                " rate_limits",
            )
        if "rate_limits" in fields:
            limits = self.rate_limits(fields["rate_limits"], config_path, inherited, flags)
        else:
            single = self.rate_limit(fields.get("rate_limit"), config_path, inherited, flags)
            limits = () if single is None else (single,)
        descriptor = DescriptorNode(
            key=key,
            value=value,
            limits=limits,
            children=NodeChildren(),
            config_path=config_path,
            pattern=WildcardPattern(value) if is_wildcard and value is not None else None,
            share_threshold=share_threshold,
            value_to_metric=self.flag(fields.get("value_to_metric"), "value_to_metric"),
            detailed_metric=flags.detailed_metric,
            line=node.start_mark.line + 1,
        )
        if not add_child(into, descriptor):
            self.error(node, f"duplicate descriptor composite key '{config_path}'")
            return
        self.descriptors(fields.get("descriptors"), descriptor.children, config_path, inherited)

    def rule_flags(self, fields: dict[str, yaml.Node]) -> _RuleFlags:
        node = fields.get("metadata")
        metadata = None if node is None else self._constructor.construct_object(node, deep=True)
        if metadata is not None and not isinstance(metadata, dict):
            self.error(node, "error parsing metadata: 'metadata' must be a mapping")
            metadata = None
        return _RuleFlags(
            shadow_mode=self.flag(fields.get("shadow_mode"), "shadow_mode"),
            quota_mode=self.flag(fields.get("quota_mode"), "quota_mode"),
            detailed_metric=self.flag(fields.get("detailed_metric"), "detailed_metric"),
            metadata=metadata,
            over_limit=self.over_limit(fields.get("over_limit")),
            usage=self.usage(fields.get("usage")),
        )

    def usage(self, node: yaml.Node | None) -> UsageSource | None:
        """Ours: ``usage: {from_header: NAME}`` or ``usage: {from_metadata: {namespace,
        key}}``, where Envoy reads what a response cost."""
        if node is None or (fields := self.mapping(node, USAGE_KEYS)) is None:
            return None
        if len(fields) != 1:
            self.error(node, "usage takes one of from_header or from_metadata")
            return None
        if "from_header" in fields:
            header = self.text(fields["from_header"], "from_header")
            if not header or not _HEADER_NAME.fullmatch(header):
                self.error(
                    fields["from_header"],
                    f"usage from_header '{header or ''}' is not a header name in lower case"
                    " (e.g. x-tokens)",
                )
                return None
            return UsageSource(header=header)
        if (source := self.mapping(fields["from_metadata"], METADATA_KEYS)) is None:
            return None
        namespace = self.text(source.get("namespace"), "namespace")
        key = self.text(source.get("key"), "key")
        if not namespace or not key or ":" in namespace:
            self.error(
                fields["from_metadata"],
                "usage from_metadata needs a namespace (no ':') and a key"
                " (e.g. {namespace: io.envoy.ai_gateway, key: llm_total_token})",
            )
            return None
        return UsageSource(metadata=(namespace, key))

    def over_limit(self, node: yaml.Node | None) -> OverLimitAnswer | None:
        """Ours: ``over_limit: {body, content_type}``, what the rule's 429 says."""
        if node is None or (fields := self.mapping(node, OVER_LIMIT_KEYS)) is None:
            return None
        body = self.text(fields.get("body"), "body")
        if not body:
            self.error(fields.get("body", node), "over_limit needs a non-empty 'body'")
            return None
        encoded = body.encode()
        if len(encoded) > MAX_OVER_LIMIT_BODY:
            message = f"over_limit body is {len(encoded)} bytes; at most {MAX_OVER_LIMIT_BODY}"
            self.error(fields["body"], message)
            return None
        content_type = self.text(fields.get("content_type"), "content_type")
        if content_type is not None and not _CONTENT_TYPE.fullmatch(content_type):
            self.error(
                fields["content_type"],
                f"over_limit content_type '{content_type}' is not a media type"
                " (e.g. application/json)",
            )
            return None
        return OverLimitAnswer(encoded, content_type)

    def rate_limits(
        self, node: yaml.Node, config_path: str, inherited: _Inherited, flags: _RuleFlags
    ) -> tuple[RateLimit, ...]:
        """Ours: several limits on one descriptor, each told apart by a label (its name,
        or its period) in its stats key and its counter."""
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            self.error(node, f"rate_limits must be a non-empty list, found {_describe(node)}")
            return ()
        limits: list[RateLimit] = []
        labels: dict[str, int] = {}
        for item in node.value:
            keys = item.value if isinstance(item, yaml.MappingNode) else []
            unlimited = [
                k for k, _ in keys if isinstance(k, yaml.ScalarNode) and k.value == "unlimited"
            ]
            if unlimited:
                self.error(unlimited[0], "unlimited has no place in rate_limits")
                continue
            limit = self.rate_limit(item, config_path, inherited, flags)
            if limit is None:
                continue
            label = list_label(limit.name, limit.unit, limit.unit_multiplier)
            if label in labels:
                self.error(
                    item,
                    f"rate_limits has two limits labelled '{label}' (line {labels[label]}):"
                    " give them different names or periods",
                )
                continue
            labels[label] = item.start_mark.line + 1
            limits.append(replace(limit, label=label, stats_key=f"{config_path}.{label}"))
        return tuple(limits)

    def rate_limit(
        self, node: yaml.Node | None, config_path: str, inherited: _Inherited, flags: _RuleFlags
    ) -> RateLimit | None:
        if node is None or self.empty(node):
            return None  # an empty `rate_limit:` is no limit, as in the Go loader
        if (limit_fields := self.mapping(node, RATE_LIMIT_KEYS)) is None:
            return None
        unlimited = self.flag(limit_fields.get("unlimited"), "unlimited")
        unit_text = self.text(limit_fields.get("unit"), "unit")
        unit = parse_unit(unit_text or "")
        if unlimited and unit_text:
            self.error(limit_fields["unit"], "should not specify rate limit unit when unlimited")
            return None
        if unlimited and "unit_multiplier" in limit_fields:
            self.error(
                limit_fields["unit_multiplier"], "should not specify unit_multiplier when unlimited"
            )
            return None
        multiplier = self.positive(limit_fields.get("unit_multiplier"), "unit_multiplier", 1)
        if multiplier is None:
            return None
        if not unlimited and unit is None:
            message = f"invalid rate limit unit '{unit_text or ''}'; valid units: {UNIT_NAMES}"
            self.error(limit_fields.get("unit", node), message)
            return None
        calendar = self.calendar(limit_fields.get("calendar"), unit, multiplier, unlimited)
        if "calendar" in limit_fields and calendar is None:
            return None
        if calendar is not None and "burst" in limit_fields:
            self.error(
                limit_fields["burst"],
                "burst has no place beside calendar: a calendar budget holds its whole"
                " limit from the start of its period",
            )
            return None
        name = self.text(limit_fields.get("name"), "name") or ""
        replaces = self.replaces(limit_fields.get("replaces"), name)
        requests_per_unit = self.requests_per_unit(limit_fields.get("requests_per_unit"))
        return RateLimit(
            requests_per_unit=requests_per_unit,
            unit=unit if unit is not None else Unit.SECOND,
            unit_multiplier=multiplier,
            name=name,
            unlimited=unlimited,
            replaces=replaces,
            shadow_mode=flags.shadow_mode,
            quota_mode=flags.quota_mode,
            detailed_metric=flags.detailed_metric,
            mode=inherited.mode,
            failure_mode=inherited.failure_mode,
            burst=self.burst(limit_fields.get("burst"), requests_per_unit),
            calendar=calendar,
            stats_key=config_path,
            metadata=flags.metadata,
            over_limit=flags.over_limit,
            usage=flags.usage,
            source=f"{self.file.name}:{node.start_mark.line + 1}",
        )

    def requests_per_unit(self, node: yaml.Node | None) -> int:
        if node is None or (value := self.scalar(node)) is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= UINT32_MAX:
            self.error(
                node,
                "requests_per_unit must be an integer from 0 to 4294967295, "
                f"found {_describe(node)}",
            )
            return 0
        return value

    def positive(self, node: yaml.Node | None, field: str, absent: int | None = None) -> int | None:
        """A whole number of at least 1 (``absent`` when not given); None after an error."""
        if node is None:
            return absent
        value = self.scalar(node)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            message = f"{field} must be a whole number of at least 1, found {_describe(node)}"
            self.error(node, message)
            return None
        return value

    def calendar(
        self, node: yaml.Node | None, unit: Unit | None, multiplier: int, unlimited: bool
    ) -> str | None:
        """Ours: count by the calendar in a time zone (core/calendar.py); None when
        absent or after an error."""
        name = self.text(node, "calendar")
        if name is None:
            if isinstance(node, yaml.ScalarNode):  # empty; text() names any other kind
                self.error(node, "calendar needs a time zone (e.g. UTC or Europe/Paris)")
            return None
        if unlimited:
            self.error(node, "calendar has no place beside unlimited")
            return None
        if unit not in CALENDAR_UNITS:
            found = unit.name.lower() if unit is not None else "none"
            self.error(node, f"calendar needs unit day, week, month or year, found {found}")
            return None
        if multiplier != 1:
            self.error(node, "a calendar period is one unit long: drop unit_multiplier")
            return None
        try:
            time_zone(name)
        except UnknownTimeZone as exc:
            self.error(node, str(exc))
            return None
        return name

    def burst(self, node: yaml.Node | None, requests_per_unit: int) -> int | None:
        """Our extension: the most a fresh key admits at once in probabilistic mode."""
        value = self.positive(node, "burst")
        if value is not None and value > requests_per_unit:
            self.error(
                node,
                f"burst {value} is above requests_per_unit {requests_per_unit}: a key"
                " never admits more than its limit at once",
            )
            return None
        return value

    def replaces(self, node: yaml.Node | None, own_name: str) -> frozenset[str]:
        names: set[str] = set()
        for item in self.items(node, "replaces"):
            if (entry := self.mapping(item, REPLACES_KEYS)) is None:
                continue
            name = self.text(entry.get("name"), "name")
            if not name:
                self.error(item, "should not have an empty replaces entry")
            elif name == own_name:
                self.error(entry["name"], "replaces should not contain name of same descriptor")
            else:
                names.add(name)
        return frozenset(names)


def _show(node: yaml.Node) -> str:
    """A node as the Go loader prints it: scalars bare, lists as ``[a b]``."""
    if isinstance(node, yaml.SequenceNode):
        return "[" + " ".join(_show(item) for item in node.value) + "]"
    if isinstance(node, yaml.MappingNode):
        pairs = (f"{_show(k)}:{_show(v)}" for k, v in node.value)
        return "map[" + " ".join(pairs) + "]"
    return str(node.value)


def _describe(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if node.tag.endswith(":null"):
        return "nothing"
    return repr(node.value) if node.tag.endswith(":str") else str(node.value)


def _syntax_error(file_name: str, exc: yaml.MarkedYAMLError) -> ConfigError:
    """A YAML syntax error in plain words, at the line and column where the parser stopped."""
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark is not None else None
    column = mark.column + 1 if mark is not None else None
    return ConfigError(
        file_name, line, f"error loading config file: invalid YAML: {_plain_yaml(exc)}", column
    )


def _plain_yaml(exc: yaml.MarkedYAMLError) -> str:
    """What PyYAML's scanner, parser or composer complains about, said for a person."""
    problem = exc.problem or exc.context or "cannot be parsed"
    context = exc.context or ""
    start = exc.context_mark
    where = f"line {start.line + 1}, column {start.column + 1}" if start is not None else ""
    found = re.search(r"but (?:found|got) '([^']*)'", problem)
    if "quoted scalar" in context and "end of stream" in problem:
        return f"the quoted string that starts at {where} is never closed"
    if problem.startswith("expected ',' or ']'"):
        return f"the list opened with '[' at {where} is not closed with ']'"
    if problem.startswith("expected ',' or '}'"):
        return f"the mapping opened with '{{' at {where} is not closed with '}}'"
    if problem.startswith("expected <block end>") and found:
        if found.group(1) == "<scalar>":
            return (
                f"unexpected text; a value may need quotes, or this line's indentation "
                f"does not match the block that starts at {where}"
            )
        return (
            f"this line's indentation does not match the block that starts at {where}; "
            "keys of one mapping, and items of one list, must line up"
        )
    if problem == "mapping values are not allowed here":
        return (
            "unexpected ':'; a value that contains ': ' needs quotes, and a key must "
            "line up with the keys above it"
        )
    if problem == "could not find expected ':'":
        return f"the key that starts at {where} has no ':' after it"
    tab = re.fullmatch(r"found character '(.*)' that cannot start any token", problem)
    if tab and tab.group(1) == "\\t":
        return "a tab character; YAML indents with spaces only"
    if tab:
        return f"'{tab.group(1)}' cannot start a value; put the value in quotes"
    alias = re.fullmatch(r"found undefined alias '(.*)'", problem)
    if alias:
        return f"'*{alias.group(1)}' refers to an anchor '&{alias.group(1)}' that is not defined"
    escape = re.fullmatch(r"found unknown escape character '(.*)'", problem)
    if escape:
        return (
            f"unknown escape '\\{escape.group(1)}' in a double-quoted string; use single "
            "quotes, or write '\\\\' for a backslash"
        )
    anchor = re.fullmatch(r"found duplicate anchor '(.*)'; first occurrence", context)
    if anchor:
        return f"the anchor '&{anchor.group(1)}' is defined twice (first at {where})"
    return f"{context}: {problem}" if exc.context and exc.problem else problem


def load_config(
    files: Sequence[ConfigFile],
    *,
    default_mode: Mode = default("--mode"),
    default_failure_mode: FailureMode = FailureMode.OPEN,
    merge_domains: bool = False,
) -> RateLimitConfig:
    """Load every file into one configuration, or raise :class:`ConfigLoadError` with all errors."""
    errors: list[ConfigError] = []
    domains: dict[str, DomainConfig] = {}
    first_seen: dict[str, str] = {}  # domain -> "file:line" where it was first defined
    inherited = _Inherited(default_mode, default_failure_mode)
    for file in files:
        loader = _FileLoader(file, inherited)
        domain = loader.load()
        errors.extend(loader.errors)
        if domain is None or loader.errors:
            continue
        existing = domains.get(domain.name)
        if existing is None:
            domains[domain.name] = domain
            line = loader.domain_line
            first_seen[domain.name] = f"{file.name}:{line}" if line else file.name
        elif merge_domains:
            merged = _merge(existing.root, domain.root, file.name, errors)
            domains[domain.name] = replace(existing, root=merged)
        else:
            first = first_seen[domain.name]
            message = f"duplicate domain '{domain.name}' in config file; first defined in {first}"
            errors.append(ConfigError(file.name, loader.domain_line, message))
    if errors:
        raise ConfigLoadError(in_file_order(errors, files))
    return RateLimitConfig(domains=domains)


def check_config(files: Sequence[ConfigFile], *, merge_domains: bool = False) -> list[ConfigError]:
    """Every error in ``files``; empty when they load."""
    try:
        load_config(files, merge_domains=merge_domains)
    except ConfigLoadError as exc:
        return list(exc.errors)
    return []


def _merge(
    base: NodeChildren, extra: NodeChildren, file_name: str, errors: list[ConfigError]
) -> NodeChildren:
    """Patch ``extra`` into ``base`` (MERGE_DOMAIN_CONFIG); a repeated key is still an error."""
    merged = NodeChildren(
        exact=dict(base.exact), wildcards=list(base.wildcards), defaults=dict(base.defaults)
    )
    for node in extra:
        if not add_child(merged, node):
            message = f"duplicate descriptor composite key '{node.config_path}'"
            errors.append(ConfigError(file_name, node.line, message))
    return merged


def add_child(children: NodeChildren, node: DescriptorNode) -> bool:
    """Index ``node`` under ``children``; False when its key/value is already there."""
    if node.value is None:
        if node.key in children.defaults:
            return False
        children.defaults[node.key] = node
    elif node.pattern is not None:
        if any(w.key == node.key and w.value == node.value for w in children.wildcards):
            return False
        children.wildcards.append(node)
    else:
        if (node.key, node.value) in children.exact:
            return False
        children.exact[(node.key, node.value)] = node
    return True


UNIT_NAMES = ", ".join(unit.name.lower() for unit in sorted(Unit, key=lambda u: UNIT_SECONDS[u]))
"""The units a rule may name, shortest first, for the error that names a wrong one."""


def _suggest(key: str, allowed: frozenset[str]) -> str:
    """ "; did you mean 'x'?" for the closest allowed key, or nothing when none is close."""
    close = difflib.get_close_matches(key.lower(), sorted(allowed), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def in_file_order(errors: Sequence[ConfigError], files: Sequence[ConfigFile]) -> list[ConfigError]:
    """Errors sorted by file (in the order the files were read), then by line."""
    rank = {file.name: index for index, file in enumerate(files)}
    return sorted(errors, key=lambda e: (rank.get(e.file, len(rank)), e.line or 0, e.column or 0))
