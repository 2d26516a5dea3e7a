"""The dashboard in a real headless browser: Debian's chromium driven by Playwright, against a live server.

Spend is made through the engine (checks and settlements over the last days, on a fixed clock, and
today on the Redis clock), drained into the rollups; the test logs in through the form, finds the
chart drawn from that data, switches the grouping from team to model and finds the chart redrawn.

Playwright's own browser downloads are not used (no `playwright install`): the browser is the
system's /usr/bin/chromium, which .ci/run installs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
from decimal import Decimal
from pathlib import Path

import pytest
from django.db.models import Sum
from django.db.models.functions import TruncDay

from quotas.models import HourlySpend
from quotas.services.usage_drain import drain_all
from tests.dashboard.conftest import PASSWORD, refuse, spend, spend_over_days

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
DAYS = 13  # days before today with spend: with today, the default 14-day range


@pytest.fixture
def chromium():
    """Starts the browser when called, in a ``with``: Playwright's sync API runs an event loop while it
    is open, and Django refuses ORM calls from inside one, so the test makes its data first."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); .ci/run installs it")
    from playwright.sync_api import sync_playwright

    @contextlib.contextmanager
    def launch():
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                yield browser
            finally:
                browser.close()

    return launch


def bars(page) -> dict[tuple[str, str], Decimal]:
    """(day, group) -> cost of every segment of the spend chart, as the browser sees the DOM."""
    found = page.eval_on_selector_all(
        "svg.spend-chart rect.seg",
        "rects => rects.map(r => [r.dataset.day, r.dataset.group, r.dataset.value, r.querySelector('title').textContent])",
    )
    assert all(title.startswith(f"{day} · ") for day, _, _, title in found)  # the hover title names the day
    return {(day, group): Decimal(value) for day, group, value, _ in found}


@pytest.mark.django_db(transaction=True)
def test_log_in_see_the_chart_and_change_the_grouping(live_server, users, policy, chromium, tmp_path):
    past = spend_over_days(policy, DAYS)
    today_spent = spend(policy, type(past)())
    refuse(policy, today_spent, n=3)
    drain_all()
    today = dt.datetime.now(dt.UTC).date().isoformat()
    # What the chart must show, from the rollups (read before the browser starts).
    by = {kind: {(hour.date().isoformat(), name): cost for hour, name, cost in
                 _per_day(HourlySpend.objects.filter(org="acme-corp"), kind)}
          for kind in ("team", "model")}
    assert len({day for day, _ in by["team"]}) == DAYS + 1
    assert sum(by["team"].values()) == past.cost + today_spent.cost
    refused = HourlySpend.objects.filter(org="acme-corp").aggregate(d=Sum("denied"))["d"]

    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        fetched: list[str] = []
        page.on("request", lambda request: fetched.append(request.url))
        page.goto(f"{live_server.url}/dashboard/")
        assert "/dashboard/login/" in page.url  # login required
        page.fill("#id_username", "viewer")
        page.fill("#id_password", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_selector("svg.spend-chart")
        assert page.url.endswith("/dashboard/")

        # Grouped by team: one segment per team and day with spend, each with its exact cost.
        assert page.inner_text("#spend h2") == "Daily spend by team"
        assert bars(page) == by["team"]
        legend = page.eval_on_selector_all(".legend li", "items => items.map(i => i.dataset.group)")
        assert sorted(legend) == ["engineering", "marketing"]
        assert page.inner_text("#kpi-denied") == str(refused)
        assert page.locator("#budgets li.budget").count() > 0
        assert page.locator('#budgets li.budget[data-level="org"][data-metric="cost"]').count() == 1
        # The stylesheet applied, and it and everything else came from the live server, not a CDN.
        assert page.evaluate("getComputedStyle(document.querySelector('.card')).borderRadius") == "10px"
        assert any(url.endswith("/static/dashboard/dashboard.css") for url in fetched)
        assert all(url.startswith(live_server.url) for url in fetched), fetched
        _screenshot(page, tmp_path / "dashboard-by-team.png")

        # Change a filter: group by model.
        page.select_option("#id_group_by", "model")
        page.click("form.filters button[type=submit]")
        page.wait_for_url("**group_by=model**")
        assert page.inner_text("#spend h2") == "Daily spend by model"
        assert bars(page) == by["model"]
        assert sorted({group for _, group in bars(page)}) == ["claude-sonnet-4", "gpt-4o", "gpt-4o-mini"]
        assert page.input_value("#id_group_by") == "model"
        _screenshot(page, tmp_path / "dashboard-by-model.png")
        # A smaller laptop screen: nothing wider than the window.
        page.set_viewport_size({"width": 1366, "height": 768})
        assert page.evaluate("document.documentElement.scrollWidth") <= 1366
        _screenshot(page, tmp_path / "dashboard-1366.png", full_page=False)

        # The CSV link downloads the same report in the same session.
        with page.expect_download() as download:
            page.click("a.csv")
        path = download.value.path()
        lines = Path(path).read_text().splitlines()
        assert lines[0].startswith("day,model,requests")
        assert len(lines) - 1 == len(by["model"]) + _zero_cost_model_days(by, lines)
        assert today in "".join(lines)

        # A bad date: a message in the page, not an error page.
        page.goto(f"{live_server.url}/dashboard/?from=2026-02-30")
        assert "Enter a valid date." in page.inner_text(".error-box")


def _per_day(rows, kind: str):
    return (rows.annotate(d=TruncDay("hour", tzinfo=dt.UTC)).values_list("d", kind)
            .annotate(cost=Sum("cost")).filter(cost__gt=0).order_by())


def _zero_cost_model_days(by, lines) -> int:
    """CSV rows with no cost (refused checks only) have no segment in the chart."""
    return sum(1 for line in lines[1:] if Decimal(line.split(",")[7]) == 0)


def _screenshot(page, path: Path, *, full_page: bool = True) -> None:
    page.screenshot(path=str(path), full_page=full_page)
    assert path.stat().st_size > 10_000
    keep = os.environ.get("AQ_DASHBOARD_SCREENSHOTS")  # a folder to keep them in, to look at
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / path.name)
