"""The dashboard's filters: a GET form, validated like any input (bad input is a message, not a 500)."""

from __future__ import annotations

from datetime import date

from django import forms
from django.utils.http import urlencode

from .data import CHART_GROUPS, MAX_DAYS, default_range

ALL = "*"  # the org choice that sums every org the user may see
FIRST_DAY, LAST_DAY = date(2000, 1, 1), date(9999, 12, 30)  # beyond these a day's end is not a datetime


class FilterForm(forms.Form):
    org = forms.ChoiceField(label="Organization")
    start = forms.DateField(label="From", input_formats=["%Y-%m-%d"],
                            widget=forms.DateInput(attrs={"type": "date"}, format="%Y-%m-%d"))
    end = forms.DateField(label="To", input_formats=["%Y-%m-%d"],
                          widget=forms.DateInput(attrs={"type": "date"}, format="%Y-%m-%d"))
    group_by = forms.ChoiceField(label="Group by", choices=[(g, g) for g in CHART_GROUPS])

    def __init__(self, params, *, orgs: list[tuple[str, str]], today: date | None = None):
        start, end = default_range(today)
        data = {"org": orgs[0][0] if orgs else "", "from": start.isoformat(), "to": end.isoformat(),
                "group_by": "team"}
        data.update({name: params[name].strip() for name in data if params.get(name, "").strip()})
        super().__init__(data)
        choices = list(orgs)
        if len(orgs) > 1:
            choices.append((ALL, "All organizations"))
        self.fields["org"].choices = choices

    def add_prefix(self, field_name: str) -> str:
        # The query string says from/to ("from" is a Python keyword, so the fields are start/end).
        return {"start": "from", "end": "to"}.get(field_name, field_name)

    def clean(self):
        data = super().clean()
        start, end = data.get("start"), data.get("end")
        for name in ("start", "end"):
            if data.get(name) and not FIRST_DAY <= data[name] <= LAST_DAY:
                self.add_error(name, f"Pick a day from {FIRST_DAY.isoformat()} to {LAST_DAY.isoformat()}.")
                return data
        if start and end:
            if end < start:
                self.add_error("end", "The end date is before the start date.")
            elif (end - start).days + 1 > MAX_DAYS:
                self.add_error("end", f"A range is at most {MAX_DAYS} days; this one has {(end - start).days + 1}.")
        return data

    def query(self, **changes) -> str:
        """The cleaned filters as a query string, with ``changes``."""
        data = self.cleaned_data
        params = {"org": data["org"], "from": data["start"].isoformat(), "to": data["end"].isoformat(),
                  "group_by": data["group_by"], **changes}
        return urlencode(params)
