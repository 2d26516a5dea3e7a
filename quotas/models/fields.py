"""Fields and validators shared by the policy tables."""

from __future__ import annotations

from django import forms
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models

from quotas.vocabulary import MODEL_PATTERN, SLUG_PATTERN, WINDOW_HINT, VocabularyError, format_window, parse_window

# Node ids and tool names end up inside Redis keys: no ':', '{', '}' or spaces.
slug_validator = RegexValidator(
    rf"^{SLUG_PATTERN}\Z",
    "Use lowercase letters, digits, '-' and '_' (1-64 characters, starting and ending with a letter or digit), "
    "e.g. 'agent-1'.",
)
model_name_validator = RegexValidator(
    rf"^{MODEL_PATTERN}\Z",
    "Use letters, digits, '.', '-', '_', '/', '@' and '+' (1-100 characters), e.g. 'gpt-4o'.",
)


class WindowFormField(forms.CharField):
    """Takes '30s', '5m', '1h' or '1d' and cleans to whole seconds."""

    def __init__(self, **kwargs):
        kwargs.pop("max_value", None)
        kwargs.pop("min_value", None)
        kwargs.pop("step_size", None)
        kwargs.setdefault("help_text", f"Rolling window: {WINDOW_HINT}. Leave empty for a calendar period or concurrency.")
        kwargs.setdefault("widget", forms.TextInput(attrs={"size": 6, "placeholder": "1h"}))
        super().__init__(**kwargs)

    def prepare_value(self, value):
        if isinstance(value, int):
            return format_window(value)
        return value

    def to_python(self, value):
        value = super().to_python(value)
        if value in self.empty_values:
            return None
        try:
            return parse_window(value)
        except VocabularyError as exc:
            raise ValidationError(str(exc), code="invalid_window") from None


class WindowField(models.PositiveIntegerField):
    """A rolling window, stored in seconds, edited as '5m'."""

    def formfield(self, **kwargs):
        kwargs["form_class"] = WindowFormField
        return super().formfield(**kwargs)
