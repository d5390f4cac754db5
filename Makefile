# moss_rt — the two commands that matter: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.run-installed
DEV_STAMP := $(VENV)/.dev-installed
# Every setting comes from Settings, MOSS_RT_* variables and flags (moss_rt/config.py); the Makefile adds
# --host/--port only when given on its command line (`make run PORT=9000`), so MOSS_RT_PORT=9000 make run
# (or a HOST variable some shells export) is never overridden here.
SERVE_FLAGS := $(if $(filter command line,$(origin HOST)),--host $(HOST)) \
	$(if $(filter command line,$(origin PORT)),--port $(PORT))
CLUSTER_STAMP := $(VENV)/.cluster-installed
PACKAGE_STAMP := $(VENV)/.package-installed

.PHONY: install run run-scripted run-cluster test test-fast test-cluster test-gpu browser postgresql soak lint bench-cpu clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): requirements.txt | $(VENV)/bin/python
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	touch $@

$(DEV_STAMP): requirements.txt requirements-dev.txt requirements-cluster.txt | $(VENV)/bin/python
	$(PY) -m pip install --disable-pip-version-check -q -r requirements-dev.txt
	touch $@ $(RUN_STAMP) $(CLUSTER_STAMP)

$(CLUSTER_STAMP): requirements.txt requirements-cluster.txt | $(VENV)/bin/python
	$(PY) -m pip install --disable-pip-version-check -q -r requirements-cluster.txt
	touch $@ $(RUN_STAMP)

# The package itself, editable (the checkout is the code that runs), so $(VENV)/bin/moss-rt exists. Offline and
# quick: --no-deps (requirements.txt brings every dependency) and --no-build-isolation (its setuptools builds it).
$(PACKAGE_STAMP): pyproject.toml $(RUN_STAMP)
	$(PY) -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	touch $@

## The runtime dependencies and the `moss-rt` command in .venv/bin (`make run` does this first).
install: $(PACKAGE_STAMP)

## Start the service (default http://127.0.0.1:8770; real model on a CUDA GPU, else the tiny demo model).
run: $(PACKAGE_STAMP)
	$(PY) -m moss_rt serve $(SERVE_FLAGS)

## The service as engine replicas on Ray (one per GPU; joins `ray start` or starts a local cluster): docs/cluster.md.
run-cluster: $(CLUSTER_STAMP) $(PACKAGE_STAMP)
	$(PY) -m moss_rt serve --cluster auto $(SERVE_FLAGS)

## The service on the scripted test engine (no model): for UI work.
run-scripted: $(PACKAGE_STAMP)
	$(PY) -m moss_rt serve --engine scripted $(SERVE_FLAGS)

# The suite runs on one pytest-xdist worker process per CPU (2 on CI; tests/conftest.py keeps a module's tests on one
# worker and the cluster tests on one); `make test TEST_WORKERS=0` runs it in this one process, `TEST_WORKERS=4` on 4.
TEST_WORKERS ?= auto

## The whole suite, one worker per CPU (sets everything up, including Chromium for the browser tests and PostgreSQL
## for the shared session store's tests). PYTHONASYNCIODEBUG=1: asyncio's debug mode (loop misuse fails loudly).
test: $(DEV_STAMP) browser postgresql
	PYTHONASYNCIODEBUG=1 $(PY) -m pytest -n $(TEST_WORKERS)

## Everything but the browser tests.
test-fast: $(DEV_STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not browser"

## Only the cluster tests (a local Ray with two tiny CPU replicas; about a minute). `-m "not cluster"` skips them.
test-cluster: $(DEV_STAMP)
	$(PY) -m pytest -m cluster

## GPU tests (on a CUDA machine).
test-gpu: $(DEV_STAMP)
	$(PY) -m pytest -m gpu

## Debian's Chromium for the end-to-end studio test (best effort: the test skips without it).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "chromium could not be installed: the browser test will be skipped"; }

## Debian's PostgreSQL for the shared session store's tests (best effort: those tests skip without it). The tests
## start their own server in a temporary folder; nothing is started here.
postgresql:
	@ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null 2>&1 || { \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) \
		|| echo "postgresql could not be installed: the PostgreSQL session-store tests will be skipped"; }

## Bounded soak test against the tiny model (minutes; not part of `make test`).
soak: $(DEV_STAMP)
	$(PY) -m tests.soak

## Ruff, then mypy over the whole package (config in pyproject.toml: strict, except Triton kernel bodies).
lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check moss_rt tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis artifacts
