# make run | make test [ARGS="tests/test_x.py -k name"] | make bench | make clean | make help
#
# With DATABASE_URL / REDIS_URL unset, run and test start embedded PostgreSQL and
# Valkey servers (data under var/dev and var/test); see project/launch.py.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
ARGS   ?=

.DEFAULT_GOAL := help
.PHONY: help run test bench clean

help:
	@echo "make run     start the service at http://127.0.0.1:$${PORT:-8000}/admin/ (Ctrl-C stops it)"
	@echo "make test    run the test suite; extra pytest arguments: make test ARGS='tests/test_x.py -k name'"
	@echo "make bench   run the benchmarks (ARGS='engine' for one of them)"
	@echo "make clean   delete var/ (embedded database data, logs, demo credentials)"
	@echo "Both run and test create $(VENV) and install requirements when needed."

$(PY):
	@echo "creating $(VENV) with $$($(PYTHON) --version)"
	$(PYTHON) -m venv $(VENV)

# The stamps make a second run skip pip until a requirements file changes.
$(VENV)/.installed-run: requirements.txt | $(PY)
	@echo "installing requirements.txt into $(VENV)"
	$(PY) -m pip install --disable-pip-version-check --progress-bar off -q -r requirements.txt
	@touch $@

$(VENV)/.installed-test: requirements-test.txt requirements.txt | $(PY)
	@echo "installing requirements-test.txt into $(VENV)"
	$(PY) -m pip install --disable-pip-version-check --progress-bar off -q -r requirements-test.txt
	@touch $@

# exec: the launcher replaces the shell, so Ctrl-C and SIGTERM reach it directly.
run: $(VENV)/.installed-run
	exec $(PY) -m project.launch run

test: $(VENV)/.installed-test
	exec $(PY) -m project.launch test -- $(ARGS)

$(VENV)/.installed-bench: requirements-bench.txt requirements-test.txt requirements.txt | $(PY)
	@echo "installing requirements-bench.txt into $(VENV)"
	$(PY) -m pip install --disable-pip-version-check --progress-bar off -q -r requirements-bench.txt
	@touch $@

bench: $(VENV)/.installed-bench
	exec $(PY) -m project.launch bench -- $(ARGS)

clean:
	@d=$${AQ_VAR_DIR:-var}; for p in dev:run test:test bench:bench; do \
	  f=$$d/$${p%%:*}/launcher.pid; \
	  if [ -f $$f ] && ! flock -n $$f true; then echo "make $${p#*:} is running (pid $$(cat $$f)); stop it first"; exit 1; fi; \
	done; echo "rm -rf $$d"; rm -rf "$$d"
