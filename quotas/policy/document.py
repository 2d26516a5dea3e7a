"""The policy file: parse and validate it, and write it back, normalised.

Pure Python (no Django import). ``parse_policy`` turns a loaded YAML/JSON
document into ``PolicyDoc`` or raises ``PolicyFileError`` listing every
mistake with its place (``orgs[0].teams[1].users[0].limits[2].window``) and
how to fix it. ``PolicyDoc.to_data()`` is the normalised document that
``export_policy`` prints: loading it gives back the same ``PolicyDoc``.

Absent keys leave what the database has alone (a file may describe part of
the policy); ``tier: null`` clears a tier.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml

from quotas.policy.rules import limit_spec_errors
from quotas.vocabulary import (
    LEVELS_TOP_DOWN,
    MODEL_RE,
    SLUG_RE,
    MONEY_METRICS,
    Level,
    Metric,
    VocabularyError,
    choices,
    format_window,
    parse_window,
)

SLUG_HINT = "use lowercase letters, digits, '-' and '_', e.g. 'agent-1'"
MODEL_HINT = "use letters, digits, '.', '-', '_', '/', '@' and '+', e.g. 'gpt-4o'"
MAX_WEIGHT = 2_147_483_647  # the column's largest
MAX_BURST = 10**15
UNSET: Any = object()  # a key the file does not mention: leave the database's value alone
CHILDREN = {Level.ORG: "teams", Level.TEAM: "users", Level.USER: "agents", Level.AGENT: None}
_NEXT_LEVEL = {Level.ORG: Level.TEAM, Level.TEAM: Level.USER, Level.USER: Level.AGENT}


class PolicyFileError(ValueError):
    """Every mistake in a policy file, each as (place, message)."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("\n".join(f"{place}: {message}" if place else message for place, message in errors))


@dataclass(frozen=True)
class LimitDoc:
    metric: str
    amount: Decimal
    window: int | None = None
    period: str = ""
    tool: str = ""
    model: str = ""
    burst: int | None = None
    shadow: bool = False
    # Budget alert thresholds (percents), sorted; None: the default for the metric; (): no alerts.
    # Keyword-only, so positional construction (metric, amount, window, ...) is unchanged.
    alert_at: tuple[int, ...] | None = field(default=None, kw_only=True)

    @property
    def key(self) -> tuple:
        return (self.metric, self.window, self.period, self.tool, self.model)

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"metric": self.metric}
        if self.tool:
            data["tool"] = self.tool
        if self.model:
            data["model"] = self.model
        data["limit"] = amount_to_data(self.metric, self.amount)
        if self.window is not None:
            data["window"] = format_window(self.window)
        if self.period:
            data["period"] = self.period
        if self.burst is not None:
            data["burst"] = self.burst
        if self.shadow:
            data["shadow"] = True
        if self.alert_at is not None:
            data["alert_at"] = list(self.alert_at)
        return data


@dataclass(frozen=True)
class OverrideDoc(LimitDoc):
    expires_at: dt.datetime | None = None
    reason: str = ""

    def to_data(self) -> dict[str, Any]:
        data = super().to_data()
        data["expires_at"] = format_datetime(self.expires_at) if self.expires_at else None
        data["reason"] = self.reason
        return data


@dataclass
class NodeDoc:
    level: Level
    slug: str
    name: str = UNSET
    tier: str | None = UNSET
    limits: list[LimitDoc] = field(default_factory=list)
    overrides: list[OverrideDoc] = field(default_factory=list)
    children: list[NodeDoc] = field(default_factory=list)

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"id": self.slug}
        if self.name is not UNSET and self.name:
            data["name"] = self.name
        if self.tier is not UNSET and self.tier is not None:
            data["tier"] = self.tier
        if self.limits:
            data["limits"] = [limit.to_data() for limit in self.limits]
        if self.overrides:
            data["overrides"] = [override.to_data() for override in self.overrides]
        if self.children:
            data[CHILDREN[self.level]] = [child.to_data() for child in self.children]
        return data

    def walk(self):
        """This node and its descendants, top-down."""
        yield self
        for child in self.children:
            yield from child.walk()


@dataclass
class TierDoc:
    slug: str
    limits: list[LimitDoc]
    level: str = ""
    description: str = ""

    def to_data(self) -> Any:
        limits = [limit.to_data() for limit in self.limits]
        level = "" if self.level is UNSET else self.level
        description = "" if self.description is UNSET else self.description
        if not level and not description:
            return limits
        data: dict[str, Any] = {}
        if level:
            data["level"] = level
        if description:
            data["description"] = description
        data["limits"] = limits
        return data


@dataclass
class PolicyDoc:
    tool_costs: dict[str, int] = field(default_factory=dict)
    model_prices: dict[str, tuple[Decimal, Decimal]] = field(default_factory=dict)
    tiers: list[TierDoc] = field(default_factory=list)
    orgs: list[NodeDoc] = field(default_factory=list)

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.tool_costs:
            data["tool_costs"] = dict(sorted(self.tool_costs.items()))
        if self.model_prices:
            data["model_prices"] = {
                model: {"input": decimal_to_data(price_in), "output": decimal_to_data(price_out)}
                for model, (price_in, price_out) in sorted(self.model_prices.items())
            }
        if self.tiers:
            data["tiers"] = {tier.slug: tier.to_data() for tier in sorted(self.tiers, key=lambda tier: tier.slug)}
        if self.orgs:
            data["orgs"] = [org.to_data() for org in self.orgs]
        return data


# ---------------------------------------------------------------------------
# Scalars
# ---------------------------------------------------------------------------


def decimal_to_data(value: Decimal) -> int | float:
    """The plainest YAML number that reads back as the same Decimal."""
    value = value.normalize()
    if value == value.to_integral_value():
        return int(value)
    return float(value)


def amount_to_data(metric: str, amount: Decimal) -> int | float:
    if metric in MONEY_METRICS:
        return decimal_to_data(amount)
    return int(amount)


def format_datetime(value: dt.datetime) -> str:
    value = value.astimezone(dt.timezone.utc)
    text = value.isoformat(timespec="microseconds" if value.microsecond else "seconds")
    return text.replace("+00:00", "Z")


def sort_limits(limits):
    return sorted(limits, key=lambda limit: (
        LIMIT_METRIC_ORDER.get(limit.metric, 99), limit.tool, limit.model, limit.window or 0, limit.period,
    ))


LIMIT_METRIC_ORDER = {metric.value: index for index, metric in enumerate(Metric)}


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------


class _Parser:
    def __init__(self, known_tiers: dict[str, str]):
        self.errors: list[tuple[str, str]] = []
        self.known_tiers = known_tiers  # slug -> level ("" for any), from the database

    def error(self, place: str, message: str) -> None:
        self.errors.append((place, message))

    def mapping(self, value: Any, place: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict | None:
        if not isinstance(value, dict):
            self.error(place, f"expected a mapping with {', '.join(allowed)}; got {_kind(value)}")
            return None
        for key in value:
            if key not in allowed:
                self.error(_join(place, str(key)), f"unknown key; expected one of {', '.join(allowed)}")
        for key in required:
            if key not in value:
                self.error(_join(place, key), "is missing")
        return value

    def sequence(self, value: Any, place: str) -> list:
        if value is None:
            return []
        if not isinstance(value, list):
            self.error(place, f"expected a list; got {_kind(value)}")
            return []
        return value

    def name(self, value: Any, place: str, *, pattern=SLUG_RE, hint=SLUG_HINT) -> str | None:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            self.error(place, f"{value!r} is not a valid name; {hint}")
            return None
        return value

    def decimal(self, value: Any, place: str, *, allow_zero: bool, places: int = 6, digits: int = 14) -> Decimal | None:
        """A number for a column of ``digits`` digits before the point and ``places`` after it."""
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            self.error(place, f"expected a number; got {_kind(value)}")
            return None
        try:
            number = Decimal(str(value))
        except InvalidOperation:
            self.error(place, f"{value!r} is not a number")
            return None
        if not number.is_finite() or number < 0 or (number == 0 and not allow_zero):
            self.error(place, f"{value!r} must be {'0 or more' if allow_zero else 'greater than 0'}")
            return None
        if number.as_tuple().exponent < -places or number >= Decimal(10) ** digits:
            self.error(place, f"{value!r} has too many digits; at most {digits} before and {places} after the point")
            return None
        return number

    # -- limits ---------------------------------------------------------------

    def limit(self, raw: Any, place: str, *, override: bool) -> LimitDoc | None:
        keys = ("metric", "limit", "window", "period", "tool", "model", "burst", "shadow", "alert_at")
        if override:
            keys += ("expires_at", "reason")
        raw = self.mapping(raw, place, keys, ("metric", "limit", *(("reason",) if override else ())))
        if raw is None or "metric" not in raw or "limit" not in raw:
            return None
        before = len(self.errors)
        metric = raw["metric"]
        if metric not in Metric.__members__.values():
            self.error(_join(place, "metric"), f"{metric!r} is not a metric; use one of {choices(Metric)}")
            return None
        amount = self.decimal(raw["limit"], _join(place, "limit"), allow_zero=False)
        window = None
        if raw.get("window") is not None:
            try:
                window = parse_window(raw["window"])
            except VocabularyError as exc:
                self.error(_join(place, "window"), str(exc))
        period = raw.get("period") or ""
        tool = raw.get("tool") or ""
        if tool:
            self.name(tool, _join(place, "tool"))
        model = raw.get("model") or ""
        if model:
            self.name(model, _join(place, "model"), pattern=MODEL_RE, hint=MODEL_HINT)
        burst = raw.get("burst")
        if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int)):
            self.error(_join(place, "burst"), f"expected a whole number; got {_kind(burst)}")
            burst = None
        elif burst is not None and burst > MAX_BURST:
            self.error(_join(place, "burst"), f"{burst} is too large; at most {MAX_BURST}")
            burst = None
        shadow = raw.get("shadow", False)
        if not isinstance(shadow, bool):
            self.error(_join(place, "shadow"), f"expected true or false; got {_kind(shadow)}")
            shadow = False
        alert_at = self.alert_at(raw.get("alert_at"), _join(place, "alert_at"), present="alert_at" in raw)
        reported = {where for where, _ in self.errors[before:]}
        for key, message in limit_spec_errors(
            metric=metric, amount=amount, window_seconds=window, period=str(period), tool=tool, model=model,
            burst=burst, alert_at=alert_at,
        ).items():
            where = _join(place, "limit" if key == "amount" else key)
            if where not in reported:  # one message per field: the first says what is wrong
                self.error(where, message)
        if len(self.errors) > before:
            return None
        alert_at = None if alert_at is None else tuple(sorted(alert_at))
        if not override:
            return LimitDoc(metric, amount, window, period, tool, model, burst, shadow, alert_at=alert_at)
        expires_at = self.datetime(raw.get("expires_at"), _join(place, "expires_at"))
        reason = raw.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            self.error(_join(place, "reason"), "say why this override exists, e.g. 'launch week, OPS-12'")
            return None
        if len(reason.strip()) > 300:
            self.error(_join(place, "reason"), "at most 300 characters")
            return None
        return OverrideDoc(metric, amount, window, period, tool, model, burst, shadow, expires_at, reason.strip(),
                           alert_at=alert_at)

    def alert_at(self, value: Any, place: str, *, present: bool) -> list[int] | None:
        """A list of whole percents (the rules check range and repeats); absent or null: the default."""
        if not present or value is None:
            return None
        if not isinstance(value, list):
            self.error(place, f"expected a list of percents such as [50, 80, 100]; got {_kind(value)}")
            return None
        for percent in value:
            if isinstance(percent, bool) or not isinstance(percent, int):
                self.error(place, f"{_kind(percent)} is not a percent; use whole numbers such as [50, 80, 100]")
                return None
        return value

    def datetime(self, value: Any, place: str) -> dt.datetime | None:
        if value is None:
            return None
        if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
            value = dt.datetime.combine(value, dt.time(), dt.timezone.utc)
        if isinstance(value, str):
            try:
                value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                self.error(place, f"{value!r} is not a date-time; use ISO 8601, e.g. 2026-12-01T00:00:00Z")
                return None
        if not isinstance(value, dt.datetime):
            self.error(place, f"expected an ISO 8601 date-time; got {_kind(value)}")
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)  # YAML's rule for timestamps without a zone
        try:
            return value.astimezone(dt.timezone.utc)
        except OverflowError:
            self.error(place, f"{value.isoformat()} is out of range; use a date before year 9999")
            return None

    def limits(self, raw: Any, place: str, *, override: bool) -> list:
        found: dict[tuple, int] = {}
        result = []
        for index, item in enumerate(self.sequence(raw, place)):
            item_place = f"{place}[{index}]"
            limit = self.limit(item, item_place, override=override)
            if limit is None:
                continue
            if limit.key in found:
                self.error(
                    item_place,
                    f"same metric, window or period, tool and model as {place}[{found[limit.key]}]; keep one of them",
                )
                continue
            found[limit.key] = index
            result.append(limit)
        return sort_limits(result)

    # -- the hierarchy ------------------------------------------------------------

    def node(self, raw: Any, place: str, level: Level, seen: dict[Level, dict[str, str]], org: str) -> NodeDoc | None:
        child_key = CHILDREN[level]
        allowed = ("id", "name", "tier", "limits", "overrides", *((child_key,) if child_key else ()))
        raw = self.mapping(raw, place, allowed, ("id",))
        if raw is None or "id" not in raw:
            return None
        slug = self.name(raw["id"], _join(place, "id"))
        if slug is not None:
            first = seen[level].get(slug)
            if first is not None:
                where = f"in {org}" if level != Level.ORG else "in this file"
                self.error(
                    _join(place, "id"),
                    f"{slug!r} is already a {level.value} {where} ({first}); {level.value} ids are unique within an org",
                )
            else:
                seen[level][slug] = place
        node = NodeDoc(level=level, slug=slug or "")
        if "name" in raw:
            if not isinstance(raw["name"], str) or len(raw["name"]) > 200:
                self.error(_join(place, "name"), "expected text of at most 200 characters")
            else:
                node.name = raw["name"]
        if "tier" in raw:
            node.tier = self.tier_reference(raw["tier"], _join(place, "tier"), level)
        node.limits = self.limits(raw.get("limits"), _join(place, "limits"), override=False)
        node.overrides = self.limits(raw.get("overrides"), _join(place, "overrides"), override=True)
        if child_key:
            org_slug = slug if level == Level.ORG else org
            for index, item in enumerate(self.sequence(raw.get(child_key), _join(place, child_key))):
                child = self.node(item, f"{_join(place, child_key)}[{index}]", _NEXT_LEVEL[level], seen, org_slug)
                if child is not None:
                    node.children.append(child)
            node.children.sort(key=lambda child: child.slug)
        return node

    def tier_reference(self, value: Any, place: str, level: Level) -> str | None:
        if value is None:
            return None
        if value not in self.known_tiers:
            known = ", ".join(sorted(self.known_tiers)) or "none yet"
            self.error(place, f"{value!r} is not a tier; define it under tiers: (known: {known})")
            return None
        tier_level = self.known_tiers[value]
        if tier_level and tier_level != level.value:
            self.error(place, f"tier {value!r} is for {tier_level} nodes; this is a {level.value}")
            return None
        return value

    def tiers(self, raw: Any) -> list[TierDoc]:
        if raw is None:
            return []
        if not isinstance(raw, dict):
            self.error("tiers", f"expected a mapping of tier name to its limits; got {_kind(raw)}")
            return []
        result = []
        for slug, body in raw.items():
            place = f"tiers.{slug}"
            if self.name(slug, place) is None:
                continue
            level, description = UNSET, UNSET  # absent: the database keeps what it has
            if isinstance(body, dict):
                body = self.mapping(body, place, ("level", "description", "limits"), ("limits",)) or {}
                if "level" in body:
                    level = body["level"] or ""
                    if level and level not in Level.__members__.values():
                        self.error(_join(place, "level"), f"{level!r} is not a level; use one of {choices(Level)}")
                        level = ""
                if "description" in body:
                    description = body["description"] or ""
                    if not isinstance(description, str):
                        self.error(_join(place, "description"), "expected text")
                        description = ""
                limits = self.limits(body.get("limits"), _join(place, "limits"), override=False)
            else:
                limits = self.limits(body, place, override=False)
            self.known_tiers[slug] = self.known_tiers.get(slug, "") if level is UNSET else level
            result.append(TierDoc(slug=slug, limits=limits, level=level, description=description))
        return result

    def tool_costs(self, raw: Any) -> dict[str, int]:
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            self.error("tool_costs", f"expected a mapping of tool name to weight; got {_kind(raw)}")
            return {}
        result = {}
        for tool, weight in raw.items():
            place = f"tool_costs.{tool}"
            if self.name(tool, place) is None:
                continue
            if isinstance(weight, bool) or not isinstance(weight, int) or not 0 < weight <= MAX_WEIGHT:
                self.error(place, f"{weight!r} is not a weight; use a whole number of credits from 1 to {MAX_WEIGHT}")
                continue
            result[tool] = weight
        return result

    def model_prices(self, raw: Any) -> dict[str, tuple[Decimal, Decimal]]:
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            self.error("model_prices", f"expected a mapping of model name to prices; got {_kind(raw)}")
            return {}
        result = {}
        for model, prices in raw.items():
            place = f"model_prices.{model}"
            if self.name(model, place, pattern=MODEL_RE, hint=MODEL_HINT) is None:
                continue
            prices = self.mapping(prices, place, ("input", "output"), ("input", "output"))
            if prices is None or "input" not in prices or "output" not in prices:
                continue
            # the columns hold 14 digits, 8 of them after the point (prices of a 1K tokens are small)
            price_in = self.decimal(prices["input"], _join(place, "input"), allow_zero=True, places=8, digits=6)
            price_out = self.decimal(prices["output"], _join(place, "output"), allow_zero=True, places=8, digits=6)
            if price_in is not None and price_out is not None:
                result[model] = (price_in, price_out)
        return result


def parse_policy(data: Any, *, known_tiers: dict[str, str] | None = None) -> PolicyDoc:
    """Validate a loaded document. ``known_tiers`` (slug -> level) are tiers already in the database."""
    parser = _Parser(dict(known_tiers or {}))
    if data is None:
        data = {}
    top = parser.mapping(data, "", ("tool_costs", "model_prices", "tiers", "orgs"))
    if top is None:
        raise PolicyFileError(parser.errors)
    doc = PolicyDoc(
        tool_costs=parser.tool_costs(top.get("tool_costs")),
        model_prices=parser.model_prices(top.get("model_prices")),
        tiers=parser.tiers(top.get("tiers")),
    )
    seen_orgs: dict[str, str] = {}
    for index, raw in enumerate(parser.sequence(top.get("orgs"), "orgs")):
        seen: dict[Level, dict[str, str]] = {level: {} for level in LEVELS_TOP_DOWN}
        seen[Level.ORG] = seen_orgs
        org = parser.node(raw, f"orgs[{index}]", Level.ORG, seen, org="")
        if org is not None:
            doc.orgs.append(org)
    if parser.errors:
        raise PolicyFileError(parser.errors)
    doc.orgs.sort(key=lambda org: org.slug)
    return doc


def read_policy_file(path: str | Path) -> Any:
    """Load YAML (or JSON) from a file; a syntax error becomes a PolicyFileError with line and column."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyFileError([("", f"cannot read {path}: {exc.strerror}")]) from None
    except UnicodeDecodeError:
        raise PolicyFileError([("", f"{path} is not UTF-8 text")]) from None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise PolicyFileError([("", f"{path}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}")]) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyFileError([("", f"{where}: not valid YAML: {problem}")]) from None


class _Dumper(yaml.SafeDumper):
    """Block style for the tree, flow style for leaf mappings (a limit per line)."""


def _scalar(value: Any) -> bool:
    return not isinstance(value, (dict, list))


def _represent_dict(dumper: yaml.SafeDumper, data: dict):
    # a list of scalars (a limit's alert_at) keeps a limit on one line
    leaf = all(_scalar(value) or (isinstance(value, list) and all(map(_scalar, value))) for value in data.values())
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=leaf)


def _represent_list(dumper: yaml.SafeDumper, data: list):
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=bool(data) and all(map(_scalar, data)))


_Dumper.add_representer(dict, _represent_dict)
_Dumper.add_representer(list, _represent_list)


def dump_policy(data: dict[str, Any]) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)


def _join(place: str, key: str) -> str:
    return f"{place}.{key}" if place else key


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return f"{value!r} ({type(value).__name__})"
