"""Request validation (strict: unknown fields and non-integers are errors) and response shapes (for the schema)."""

from __future__ import annotations

import datetime as dt

from rest_framework import serializers

from quotas.models.fields import model_name_validator, slug_validator
from quotas.vocabulary import MODEL_RE, SLUG_RE

MAX_TOKENS = 10**9
MAX_BATCH = 100


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer, never a string, float or boolean."""

    default_error_messages = {"invalid": "must be a whole number (a JSON integer)"}

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictCharField(serializers.CharField):
    """A JSON string as sent: never a number turned into one, never trimmed of spaces."""

    default_error_messages = {"invalid": "must be a string"}

    def __init__(self, **kwargs):
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


def printable(name: str) -> str:
    """A name from the request, safe to echo in an answer (lone surrogates cannot be encoded)."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


class StrictSerializer(serializers.Serializer):
    """Rejects fields it does not know, naming them and what it expects."""

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["expected a JSON object"]})
        unknown = sorted(printable(str(name)) for name in set(data) - set(self.fields))
        if unknown:
            expected = ", ".join(self.fields)
            raise serializers.ValidationError({name: [f"unknown field; expected {expected}"] for name in unknown})
        return super().to_internal_value(data)


def agent_field():
    return StrictCharField(max_length=64, validators=[slug_validator], help_text="The agent's id, e.g. agent-1.")


class CheckInput(StrictSerializer):
    agent = agent_field()
    tool = StrictCharField(max_length=64, required=False, allow_null=True, validators=[slug_validator],
                                 help_text="The tool about to be called (its weight is the call's credits).")
    model = StrictCharField(max_length=100, required=False, allow_null=True, validators=[model_name_validator],
                                  help_text="The model about to be called (its price gives the cost).")
    tokens = StrictIntegerField(min_value=0, max_value=MAX_TOKENS, required=False, default=0,
                                help_text="Estimated tokens; settled later with POST /api/v1/usage.")


class CheckBatchInput(StrictSerializer):
    checks = serializers.ListField(child=CheckInput(), min_length=1, max_length=MAX_BATCH,
                                   help_text=f"Up to {MAX_BATCH} checks, each decided on its own.")


class UsageInput(StrictSerializer):
    reservation = StrictCharField(max_length=300, help_text="The id a check returned.")
    input_tokens = StrictIntegerField(min_value=0, max_value=MAX_TOKENS)
    output_tokens = StrictIntegerField(min_value=0, max_value=MAX_TOKENS)


class LeaseInput(StrictSerializer):
    agent = agent_field()
    ttl_s = StrictIntegerField(min_value=1, max_value=86400, required=False, default=300,
                               help_text="Seconds until the slot frees itself unless renewed.")


class LeaseRenewInput(StrictSerializer):
    ttl_s = StrictIntegerField(min_value=1, max_value=86400, required=False, default=300)


class PeekQuery(StrictSerializer):
    tool = serializers.CharField(max_length=64, required=False, validators=[slug_validator])
    model = serializers.CharField(max_length=100, required=False, validators=[model_name_validator])
    tokens = serializers.IntegerField(min_value=0, max_value=MAX_TOKENS, required=False, default=0)


class DailySpendQuery(StrictSerializer):
    GROUPS = ("team", "user", "agent", "model", "tool")
    # "from" is a Python keyword: declared through the class namespace.
    locals()["from"] = serializers.DateField(help_text="First day, YYYY-MM-DD (UTC).")
    to = serializers.DateField(help_text="Last day, YYYY-MM-DD (UTC), inclusive.")
    group_by = serializers.ChoiceField(choices=GROUPS, required=False, default="team")
    format = serializers.ChoiceField(choices=("json", "csv"), required=False, default="json")

    def validate(self, data):
        if data["from"] > data["to"]:
            raise serializers.ValidationError({"to": ["must not be before from"]})
        if (data["to"] - data["from"]).days > 366:
            raise serializers.ValidationError({"to": ["at most 366 days after from"]})
        if data["to"] >= dt.date.max:
            raise serializers.ValidationError({"to": [f"must be before {dt.date.max.isoformat()}"]})
        return data


# -- responses (documentation; the views build plain dicts) ---------------------------------


class LimitOutput(serializers.Serializer):
    level = serializers.ChoiceField(choices=("org", "team", "user", "agent"))
    node = serializers.CharField()
    metric = serializers.ChoiceField(choices=("requests", "credits", "tokens", "cost", "concurrency"))
    limit = serializers.FloatField(help_text="USD for cost, whole units otherwise.")
    remaining = serializers.FloatField()
    window = serializers.CharField(allow_null=True, help_text="30s, 5m, 1h, 1d... or day / month; null for concurrency.")
    tool = serializers.CharField(allow_null=True)
    model = serializers.CharField(allow_null=True)
    reset_ms = serializers.IntegerField(help_text="Until what is used now has left the window.")
    shadow = serializers.BooleanField()


class CheckAllowedOutput(serializers.Serializer):
    allowed = serializers.BooleanField()
    reservation = serializers.CharField(allow_null=True)
    limits = LimitOutput(many=True)
    would_block = LimitOutput(many=True, help_text="Shadow limits that would have blocked.")


class CheckDeniedOutput(serializers.Serializer):
    allowed = serializers.BooleanField()
    blocked_by = LimitOutput()
    retry_after_ms = serializers.IntegerField(allow_null=True, help_text="null: the request can never pass.")
    limits = LimitOutput(many=True)


class CheckBatchOutput(serializers.Serializer):
    results = serializers.ListField(child=serializers.DictField(),
                                    help_text="One per check, in order: a check answer, or an error object.")


class UsageOutput(serializers.Serializer):
    reservation = serializers.CharField()
    status = serializers.ChoiceField(choices=("settled", "repeat", "expired"))
    tokens = serializers.IntegerField(allow_null=True)
    cost = serializers.FloatField(allow_null=True)
    estimated_tokens = serializers.IntegerField()
    estimated_cost = serializers.FloatField()


class LeaseOutput(serializers.Serializer):
    lease = serializers.CharField()
    expires_at = serializers.DateTimeField()


class QuotaOutput(serializers.Serializer):
    agent = serializers.CharField()
    limits = LimitOutput(many=True)


class DailySpendRow(serializers.Serializer):
    day = serializers.DateField()
    team = serializers.CharField(required=False, help_text="The group's value, under the group_by name "
                                 "(team, user, agent, model or tool; empty for calls with no tool or model).")
    requests = serializers.IntegerField(help_text="Admitted checks.")
    credits = serializers.IntegerField(help_text="Tool weights of the admitted checks.")
    tokens = serializers.IntegerField(help_text="As budgets count them: the estimate until settled, then the actual.")
    input_tokens = serializers.IntegerField(help_text="Settled input tokens.")
    output_tokens = serializers.IntegerField(help_text="Settled output tokens.")
    cost = serializers.DecimalField(max_digits=24, decimal_places=9, coerce_to_string=True,
                                    help_text="USD as a decimal string, exact (estimate until settled).")
    unsettled = serializers.IntegerField(help_text="Reservations that expired without a usage report.")
    denied = serializers.IntegerField(help_text="Refused checks.")


class DailySpendOutput(serializers.Serializer):
    locals()["from"] = serializers.DateField()
    to = serializers.DateField()
    group_by = serializers.CharField()
    rows = DailySpendRow(many=True)


class ErrorOutput(serializers.Serializer):
    error = serializers.CharField()
    detail = serializers.CharField()


# -- the hot path's validation -------------------------------------------------------------------
# Building a DRF serializer costs about 0.3 ms a request (it deep-copies its fields), as much as the
# rest of a check. `fast_check` accepts the common, well-formed body in a few microseconds; anything
# it does not accept outright goes to the serializer, which gives the answer (and the error message).
# So it must never accept what CheckInput would refuse: tests/api/test_fast_validation.py holds it.

CHECK_FIELDS = frozenset(("agent", "tool", "model", "tokens"))


def fast_check(data) -> dict | None:
    """The validated check, or None when the serializer must decide."""
    if type(data) is not dict or not data.keys() <= CHECK_FIELDS:
        return None
    agent, tool, model, tokens = data.get("agent"), data.get("tool"), data.get("model"), data.get("tokens", 0)
    if type(agent) is not str or not SLUG_RE.fullmatch(agent):
        return None
    if tool is not None and (type(tool) is not str or not SLUG_RE.fullmatch(tool)):
        return None
    if model is not None and (type(model) is not str or not MODEL_RE.fullmatch(model)):
        return None
    if type(tokens) is not int or not 0 <= tokens <= MAX_TOKENS:
        return None
    return {"agent": agent, "tool": tool, "model": model, "tokens": tokens}


def check_input(data) -> dict:
    fast = fast_check(data)
    if fast is not None:
        return fast
    serializer = CheckInput(data=data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def check_batch_input(data) -> list[dict]:
    checks = data.get("checks") if type(data) is dict and data.keys() == {"checks"} else None
    if type(checks) is list and 1 <= len(checks) <= MAX_BATCH:
        fast = [fast_check(item) for item in checks]
        if all(item is not None for item in fast):
            return fast
    serializer = CheckBatchInput(data=data)
    serializer.is_valid(raise_exception=True)
    return [dict(item) for item in serializer.validated_data["checks"]]
