from django.core.management.base import BaseCommand, CommandError

from quotas.models import Organization
from quotas.services.api_keys import api_key_create


class Command(BaseCommand):
    help = "Create an API key for ORG and print it (only the key, on stdout). It cannot be shown again."

    def add_arguments(self, parser):
        parser.add_argument("org", help="the organization's id, e.g. acme-corp")
        parser.add_argument("--name", default="", help="what will use the key, e.g. gateway-prod")

    def handle(self, *args, org, name, **options):
        organization = Organization.objects.filter(slug=org).first()
        if organization is None:
            known = ", ".join(Organization.objects.order_by("slug").values_list("slug", flat=True)[:10]) or "none"
            raise CommandError(f"no organization {org!r} (known: {known})")
        _, raw = api_key_create(org=organization, name=name)
        self.stdout.write(raw)
