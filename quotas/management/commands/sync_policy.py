from django.core.management.base import BaseCommand

from quotas.services.policy_sync import policy_sync_all


class Command(BaseCommand):
    help = "Write the whole policy from Postgres to Redis (repairs a flushed or restarted Redis)."

    def handle(self, *args, **options):
        total = policy_sync_all(progress=lambda org, count: self.stdout.write(f"  {org}: {count} agents"))
        self.stdout.write(self.style.SUCCESS(f"synced {total} agents"))
