"""docker-compose.yml and project/settings.py agree on the environment.

There is no Docker engine in CI, so this reads both files: every variable the
app services set must be one that settings.py reads (a typo there would be
silently ignored), and every variable settings.py requires must be set.
"""

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SETTINGS = (REPO / "project" / "settings.py").read_text()
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())

READ = re.compile(
    r"""(?:\benv_(?:str|bool|int|list|required)|os\.environ\.get|os\.getenv)\(\s*["']([A-Z][A-Z0-9_]*)["']"""
    r"""|os\.environ\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\]"""
)
REQUIRED = re.compile(r"""\benv_required\(\s*["']([A-Z][A-Z0-9_]*)["']""")

APP_SERVICES = ("web", "worker", "beat")


def names_read_by_settings() -> set[str]:
    return {a or b for a, b in READ.findall(SETTINGS)}


def environment(service: dict) -> dict:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the `- NAME=value` form
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return env


def test_settings_scan_finds_the_known_names():
    # Guards the regex: if it stopped matching, the tests below would pass vacuously.
    read = names_read_by_settings()
    assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG", "ALLOWED_HOSTS", "QUOTAS_FAIL_MODE"} <= read
    assert {"DATABASE_URL", "REDIS_URL"} <= set(REQUIRED.findall(SETTINGS))


def app_services() -> dict[str, dict]:
    """web, worker, beat and any other service built from the Dockerfile (migrate)."""
    services = COMPOSE["services"]
    found = {name: svc for name, svc in services.items() if "build" in svc}
    assert set(APP_SERVICES) <= set(found), f"compose lacks app services: {sorted(services)}"
    return found


@pytest.mark.parametrize("name", APP_SERVICES + ("migrate",))
def test_compose_sets_only_variables_that_settings_reads(name):
    service = app_services().get(name)
    if service is None:
        pytest.skip(f"no {name} service")
    unknown = set(environment(service)) - names_read_by_settings()
    assert not unknown, f"{name} sets {sorted(unknown)}, which project/settings.py never reads"


@pytest.mark.parametrize("name", APP_SERVICES)
def test_compose_sets_every_required_variable(name):
    # SECRET_KEY is not env_required (DEBUG=true allows a throwaway key), but compose runs with DEBUG=false.
    required = set(REQUIRED.findall(SETTINGS)) | {"SECRET_KEY"}
    env = environment(app_services()[name])
    missing = {n for n in required if not env.get(n)}
    assert not missing, f"{name} does not set {sorted(missing)}"
    assert str(env.get("DEBUG", "false")).lower() in {"false", "0", "no", "off"}


def test_app_services_run_the_expected_processes():
    services = app_services()
    command = {name: " ".join(map(str, services[name].get("command") or [])) for name in APP_SERVICES}
    assert "gunicorn project.wsgi:application" in command["web"]
    assert "celery -A project worker" in command["worker"]
    assert "celery -A project beat" in command["beat"]
    # The schema is migrated before the app starts: by a one-shot service or by web's command.
    migrate = services.get("migrate", {})
    if "migrate" in " ".join(map(str, migrate.get("command") or [])):
        for name in APP_SERVICES:
            depends = services[name].get("depends_on") or {}
            assert depends.get("migrate", {}).get("condition") == "service_completed_successfully", name
    else:
        assert "manage.py migrate" in command["web"]


def test_backing_services_use_stock_images():
    services = COMPOSE["services"]
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["valkey"]["image"].startswith(("valkey/valkey:", "redis:"))
    env = environment(app_services()["web"])
    assert env["DATABASE_URL"].startswith("postgres://") and "@postgres:" in env["DATABASE_URL"]
    assert env["REDIS_URL"].startswith("redis://valkey:")


def test_the_secret_key_has_no_default_to_forget():
    for name, service in app_services().items():
        value = str(environment(service).get("SECRET_KEY", ""))
        assert value.startswith("${SECRET_KEY:?"), f"{name}: SECRET_KEY must be required, not defaulted: {value}"
