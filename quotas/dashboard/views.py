"""The dashboard's views: validate the filters, check who may see the org, call data and charts."""

from __future__ import annotations

from decimal import Decimal

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from quotas.services.reports import as_csv, daily_spend

from . import charts
from .data import MAX_PEEKS, TOP_AGENT_BUDGETS, dashboard_data, visible_orgs
from .forms import ALL, FilterForm

LOGIN = "dashboard:login"


def _filters(request: HttpRequest) -> tuple[FilterForm, list[str]]:
    """The bound filter form and the orgs it selects; 404 for an org this user may not see."""
    orgs = visible_orgs(request.user)
    form = FilterForm(request.GET, orgs=[(org.slug, org.name or org.slug) for org in orgs])
    slugs = [org.slug for org in orgs]
    wanted = form.data["org"]
    if wanted and wanted not in slugs and not (wanted == ALL and len(slugs) > 1):
        raise Http404("No such organization, or you may not see it.")
    return form, (slugs if wanted == ALL else [wanted] if wanted else [])


@require_GET
@login_required(login_url=LOGIN)
def index(request: HttpRequest) -> HttpResponse:
    form, orgs = _filters(request)
    context = {"form": form, "orgs": orgs}
    if not orgs:
        return render(request, "dashboard/index.html", {**context, "no_orgs": True})
    if not form.is_valid():
        return render(request, "dashboard/index.html", context, status=400)
    data = form.cleaned_data
    board = dashboard_data(orgs=orgs, start=data["start"], end=data["end"], group_by=data["group_by"])
    spend = board.spend
    series = charts.spend_series(spend.days, spend.groups, spend.cost_by_group_day, spend.group_by)
    denied = [charts.Series("refused", "refused", "#e15759",
                            [Decimal(spend.denied_by_day[day]) for day in spend.days])]
    context.update(
        board=board,
        spend=spend,
        series=series,
        spend_chart=charts.stacked_bars(spend.days, series, label="Cost (USD)", css_class="chart spend-chart"),
        denied_chart=charts.stacked_bars(spend.days, denied, label="Refused checks", money=False,
                                         css_class="chart denied-chart", width=520, height=220),
        csv_query=form.query(),
        max_peeks=MAX_PEEKS,
        top_agent_budgets=TOP_AGENT_BUDGETS,
    )
    return render(request, "dashboard/index.html", context)


@require_GET
@login_required(login_url=LOGIN)
def spend_csv(request: HttpRequest) -> HttpResponse:
    """The chart's data as CSV (reports.as_csv: the same columns as the reports API's CSV)."""
    form, orgs = _filters(request)
    if not orgs:
        raise Http404("No organization to report on.")
    if not form.is_valid():
        errors = "; ".join(f"{form.add_prefix(name)}: {' '.join(messages)}" for name, messages in form.errors.items())
        return HttpResponse(f"Bad filters: {errors}\n", status=400, content_type="text/plain; charset=utf-8")
    data = form.cleaned_data
    rows = daily_spend(orgs=orgs, start=data["start"], end=data["end"], group_by=data["group_by"])
    name = "all" if len(orgs) > 1 else orgs[0]
    response = HttpResponse(as_csv(rows, data["group_by"]), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = (
        f'attachment; filename="spend-{name}-{data["start"]}-{data["end"]}-{data["group_by"]}.csv"'
    )
    return response
