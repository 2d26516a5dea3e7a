import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from quotas.models import Organization
from quotas.policy.document import parse_policy, read_policy_file
from quotas.selectors import known_tiers
from quotas.services.api_keys import api_key_create
from quotas.services.policy_load import policy_load

DEMO_FILE = Path(__file__).resolve().parents[2] / "fixtures" / "demo_policy.yaml"
DEMO_ORG = "acme-corp"


class Command(BaseCommand):
    help = (
        "Load the Acme Corp demo policy, create (or reset) the superuser 'admin' and a demo API key, "
        "and print how to log in. The credentials are also written to var/demo-credentials.txt."
    )

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin")
        parser.add_argument("--password", default=None, help="default: a new random password")

    def handle(self, *args, username, password, **options):
        password = password or secrets.token_urlsafe(12)
        with transaction.atomic():
            report = policy_load(doc=parse_policy(read_policy_file(DEMO_FILE), known_tiers=known_tiers()))
            User = get_user_model()
            user = User.objects.filter(username=username).first() or User(username=username)
            user.is_staff = user.is_superuser = True
            user.set_password(password)
            user.save()
            _, raw_key = api_key_create(org=Organization.objects.get(slug=DEMO_ORG), name="demo")
        text = (
            f"Admin:    log in as {username} / {password}\n"
            f"API key:  {raw_key} (org {DEMO_ORG})\n"
        )
        credentials = Path(settings.VAR_DIR) / "demo-credentials.txt"
        credentials.parent.mkdir(parents=True, exist_ok=True)
        credentials.touch(mode=0o600)
        credentials.write_text(text)
        self.stdout.write(f"Demo policy loaded ({report.summary()}).")
        self.stdout.write(text, ending="")
        self.stdout.write(f"(saved in {credentials})")
