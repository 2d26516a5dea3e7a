import json

from django.core.management.base import BaseCommand

from quotas.policy.document import dump_policy
from quotas.selectors import policy_export


class Command(BaseCommand):
    help = "Print the whole policy in the policy file format (YAML, or JSON with --format json)."

    def add_arguments(self, parser):
        parser.add_argument("--format", choices=["yaml", "json"], default="yaml")

    def handle(self, *args, format, **options):
        data = policy_export().to_data()
        if format == "json":
            self.stdout.write(json.dumps(data, indent=2))
        else:
            self.stdout.write(dump_policy(data), ending="")
