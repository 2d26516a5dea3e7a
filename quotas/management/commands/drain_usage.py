from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError
from redis.exceptions import RedisError

from quotas.services.usage_drain import drain_all


class Command(BaseCommand):
    help = (
        "Drain the usage streams into the hourly spend rollups once (what Celery beat does every "
        "QUOTAS_DRAIN_INTERVAL_S seconds). Safe to run beside the scheduled drain."
    )

    def add_arguments(self, parser):
        parser.add_argument("--batch", type=int, default=None, help="entries per batch (QUOTAS_DRAIN_BATCH)")
        parser.add_argument("--max-seconds", type=float, default=3600.0, help="stop after this long (default 3600)")

    def handle(self, *args, batch=None, max_seconds=3600.0, verbosity=1, **options):
        if batch is not None and batch < 1:
            raise CommandError("--batch must be at least 1")

        def progress(stream, result):
            if verbosity > 1 or result.batches % 20 == 0:
                self.stdout.write(f"  {stream}: {result.events} events in {result.batches} batches")

        try:
            result = drain_all(batch=batch, max_seconds=max_seconds, progress=progress)
        except DatabaseError as error:  # before any stream: the list of orgs
            raise CommandError(f"PostgreSQL failed; nothing was read, run again: {error}")
        except RedisError as error:
            raise CommandError(f"Redis failed; nothing is lost, run again: {error}")
        for stream in result.busy:
            self.stdout.write(self.style.WARNING(f"  {stream}: another drain holds it; skipped"))
        repeats = f" ({result.repeats} already counted, acknowledged)" if result.repeats else ""
        summary = f"drained {result.events} events in {result.batches} batches{repeats}"
        if result.failed:
            failures = "".join(f"\n  {stream}: {error}" for stream, error in result.failed.items())
            raise CommandError(f"{summary}; {len(result.failed)} streams failed (what was read stays pending and "
                               f"drains next time):{failures}")
        self.stdout.write(self.style.SUCCESS(summary))
