"""Shared fixtures. `make test` (project/launch.py) provides DATABASE_URL,
REDIS_URL and a random QUOTAS_REDIS_KEY_PREFIX; pytest-django does the rest."""
