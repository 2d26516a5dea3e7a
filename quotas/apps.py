from django.apps import AppConfig


class QuotasConfig(AppConfig):
    name = "quotas"
    verbose_name = "Quotas"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from quotas import signals

        signals.connect()
