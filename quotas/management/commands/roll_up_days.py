from datetime import date

from django.core.management.base import BaseCommand, CommandError

from quotas.services.reports import days_in
from quotas.services.rollups import due_days, roll_up_day, today_utc


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise CommandError(f"{text!r} is not a date; use YYYY-MM-DD") from None


class Command(BaseCommand):
    help = (
        "Roll finished UTC days up into daily spend rows (what Celery beat does after 00:00 UTC). "
        "Without --from: every day of the last 35 with hourly rows and no valid rollup."
    )

    def add_arguments(self, parser):
        parser.add_argument("--from", dest="start", help="first day, YYYY-MM-DD")
        parser.add_argument("--to", dest="end", help="last day, YYYY-MM-DD (default: yesterday, UTC)")

    def handle(self, *args, start=None, end=None, **options):
        yesterday = date.fromordinal(today_utc().toordinal() - 1)
        if start is None and end is not None:
            raise CommandError("--to needs --from")
        if start is None:
            days = due_days()
        else:
            first, last = _day(start), _day(end) if end else yesterday
            if last < first:
                raise CommandError("--to is before --from")
            if last > yesterday:
                raise CommandError(f"{last} is not over yet (UTC); the last day to roll up is {yesterday}")
            days = days_in(first, last)
        for day in days:
            rows = roll_up_day(day)
            self.stdout.write(f"  {day}: {rows} rows")
        self.stdout.write(self.style.SUCCESS(f"rolled up {len(days)} days"))
