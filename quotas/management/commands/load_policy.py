from django.core.management.base import BaseCommand, CommandError

from quotas.policy.document import PolicyFileError, parse_policy, read_policy_file
from quotas.selectors import known_tiers
from quotas.services.policy_load import policy_load

SHOWN = 20


class Command(BaseCommand):
    help = "Apply a policy file (YAML or JSON): create or update, in one transaction. A bad file changes nothing."

    def add_arguments(self, parser):
        parser.add_argument("file", help="policy file, .yaml/.yml or .json ('-' is not supported)")
        parser.add_argument("--prune", action="store_true", help="also delete what the database has and the file does not")

    def handle(self, *args, file, prune, **options):
        try:
            doc = parse_policy(read_policy_file(file), known_tiers=known_tiers())
            report = policy_load(doc=doc, prune=prune)
        except PolicyFileError as exc:
            raise CommandError(f"{file}: nothing was changed.\n{exc}") from None
        self.stdout.write(self.style.SUCCESS(f"{file}: {report.summary()}"))
        for name, count in report.also_deleted.items():
            self.stdout.write(self.style.WARNING(f"  with them deleted: {count} {name}"))
        if report.not_in_file:
            self.stdout.write(
                f"{len(report.not_in_file)} in the database but not in the file (kept; --prune deletes them):"
            )
            for line in report.not_in_file[:SHOWN]:
                self.stdout.write(f"  {line}")
            if len(report.not_in_file) > SHOWN:
                self.stdout.write(f"  ... and {len(report.not_in_file) - SHOWN} more")
