"""Settings for agent-quotas, read from the environment.

Every variable is listed, with its default, in the README's configuration
table; tests/test_settings_env.py keeps that table, this module and
docker-compose.yml in step.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url
from celery.schedules import crontab
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
# Runtime data of the embedded servers, the demo credentials, collected static files.
VAR_DIR = Path(os.environ.get("AQ_VAR_DIR") or BASE_DIR / "var")


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r}: use true or false")


def env_int(name: str, default: int, *, minimum: int = 0) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r}: use a whole number") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name}={raw!r}: use a number >= {minimum}")
    return value


def env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in env_str(name, default).split(",") if item.strip()]


def env_required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ImproperlyConfigured(
            f"{name} is not set. `make run` and `make test` set it for you "
            f"(they start embedded servers); otherwise export it, see the README."
        )
    return value


# ---------------------------------------------------------------------------
# Core
# ---------------------------------------------------------------------------
DEBUG = env_bool("DEBUG", False)
SECRET_KEY = os.environ.get("SECRET_KEY") or ""
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY is not set (or set DEBUG=true for a throwaway development key).")
    SECRET_KEY = "dev-insecure-only-for-debug"
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "127.0.0.1,localhost")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", "")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "quotas",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"
WSGI_APPLICATION = "project.wsgi.application"
ASGI_APPLICATION = "project.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# ---------------------------------------------------------------------------
# Database: DATABASE_URL, e.g. postgres://user:pass@host:5432/agent_quotas
# ---------------------------------------------------------------------------
DATABASES = {
    "default": dj_database_url.parse(env_required("DATABASE_URL"), conn_max_age=60, conn_health_checks=True),
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# ---------------------------------------------------------------------------
# Redis / Valkey: REDIS_URL is the hot path's store, the cache and the broker.
# ---------------------------------------------------------------------------
REDIS_URL = env_required("REDIS_URL")
# The hot path's connection to the same server: a unix:// URL where Valkey runs on the same machine
# (the embedded one does) spares client and server the kernel's TCP path on every check.
QUOTAS_REDIS_URL = env_str("QUOTAS_REDIS_URL", REDIS_URL)
QUOTAS_REDIS_CONNECT_TIMEOUT_MS = env_int("QUOTAS_REDIS_CONNECT_TIMEOUT_MS", 200, minimum=1)
QUOTAS_REDIS_READ_TIMEOUT_MS = env_int("QUOTAS_REDIS_READ_TIMEOUT_MS", 500, minimum=1)
# Every key the service writes starts with this prefix (tests use a random one).
QUOTAS_REDIS_KEY_PREFIX = env_str("QUOTAS_REDIS_KEY_PREFIX", "aq")

CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": f"{QUOTAS_REDIS_KEY_PREFIX}:cache",
        "OPTIONS": {
            "CLIENT_CLASS": "django_redis.client.DefaultClient",
            "SOCKET_CONNECT_TIMEOUT": QUOTAS_REDIS_CONNECT_TIMEOUT_MS / 1000,
            "SOCKET_TIMEOUT": QUOTAS_REDIS_READ_TIMEOUT_MS / 1000,
        },
    }
}

# ---------------------------------------------------------------------------
# Quotas
# ---------------------------------------------------------------------------
QUOTAS_FAIL_MODE = env_str("QUOTAS_FAIL_MODE", "closed")
if QUOTAS_FAIL_MODE not in {"closed", "open"}:
    raise ImproperlyConfigured(f"QUOTAS_FAIL_MODE={QUOTAS_FAIL_MODE!r}: use closed or open")
# An unsettled reservation counts at its estimate after this many seconds.
QUOTAS_RESERVATION_TTL_S = env_int("QUOTAS_RESERVATION_TTL_S", 600, minimum=1)
# Seconds between full policy resyncs (repairs a flushed or restarted Redis).
QUOTAS_RESYNC_INTERVAL_S = env_int("QUOTAS_RESYNC_INTERVAL_S", 60, minimum=1)
# The spend pipeline: how often beat drains the usage streams, and how many entries a batch holds.
QUOTAS_DRAIN_INTERVAL_S = env_int("QUOTAS_DRAIN_INTERVAL_S", 5, minimum=1)
QUOTAS_DRAIN_BATCH = env_int("QUOTAS_DRAIN_BATCH", 5000, minimum=1)
# Seconds between budget alert evaluations (the budgets of agents that spent since the last one).
QUOTAS_ALERT_INTERVAL_S = env_int("QUOTAS_ALERT_INTERVAL_S", 30, minimum=1)

# ---------------------------------------------------------------------------
# Celery: configured from these CELERY_* settings (namespace="CELERY").
# ---------------------------------------------------------------------------
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": f"{QUOTAS_REDIS_KEY_PREFIX}:celery:"}
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULE = {
    "sync-policy": {"task": "quotas.tasks.sync_policy_all", "schedule": QUOTAS_RESYNC_INTERVAL_S},
    "sweep-reservations": {"task": "quotas.tasks.sweep_reservations", "schedule": 30},
    "drain-usage": {"task": "quotas.tasks.drain_usage", "schedule": QUOTAS_DRAIN_INTERVAL_S},
    # Every 15 minutes: the first run after 00:00 UTC rolls up the day before; later runs catch up
    # days a late event un-rolled (and days missed while beat was down).
    "roll-up-days": {"task": "quotas.tasks.roll_up_days", "schedule": crontab(minute="*/15")},
    "evaluate-budget-alerts": {"task": "quotas.tasks.evaluate_budget_alerts", "schedule": QUOTAS_ALERT_INTERVAL_S},
}

# ---------------------------------------------------------------------------
# Auth, i18n, static files
# ---------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "admin:login"
# Messages in the session (server side), not in a cookie: the admin shows a new API key in one.
MESSAGE_STORAGE = "django.contrib.messages.storage.session.SessionStorage"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(VAR_DIR / "static")))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Serve straight from the apps' static folders when DEBUG (no collectstatic needed).
WHITENOISE_USE_FINDERS = DEBUG

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["quotas.api.auth.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["quotas.api.parsers.StrictJSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["quotas.api.renderers.FastJSONRenderer"],
    "EXCEPTION_HANDLER": "quotas.api.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
    "URL_FORMAT_OVERRIDE": None,  # ?format= belongs to the views (CSV reports)
}
SPECTACULAR_SETTINGS = {
    "TITLE": "agent-quotas check API",
    "DESCRIPTION": "Hierarchical rate limits, token and USD budgets and concurrency slots for AI agents. "
                   "Authenticate with `Authorization: Bearer <key>` (`manage.py create_api_key ORG`).",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    "SWAGGER_UI_DIST": "SIDECAR",  # served from this server, never a CDN
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "quotas.api.schema.strict_request_bodies",
    ],
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "filters": {"skip_refusals": {"()": "quotas.api.log_filters.SkipRefusals"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.request": {"handlers": ["console"], "level": "WARNING", "filters": ["skip_refusals"],
                           "propagate": False},
    },
}
