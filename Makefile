# pipeplan: `make demo` runs the main job end to end (start the local emulated cluster, measure a
# profile, plan with exact/learned planners and baselines, run them for real, print the table,
# draw the Gantt chart, stop the cluster: ~3 minutes); `make test` runs the tests (all of them),
# `make test-fast` those that start no Ray cluster, build no RLlib algorithm, drive no browser
# and are not marked slow (pytest -m; under 2 minutes on 2 cores).
# Both create .venv when it is missing and install the project into it. `make serve` runs the
# service (pipeplan serve: REST API on 127.0.0.1:8321, jobs as Ray Jobs on an embedded
# local-hetero cluster, stopped with it; SERVE_ARGS adds flags, e.g. --port 8400). `make docs`
# builds the documentation into build/site (offline; docs/development.md says how).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= build/demo
MODEL ?= alexnet
INPUT_SIZE ?= 224
BATCH ?= 32
CLUSTER ?= examples/clusters/local-pipeline.yaml
SERVE_ARGS ?=

.PHONY: install lock test test-fast demo serve lint bench docs clean

# requirements.lock pins every package `make` installs (a reproducible environment);
# `make lock` writes it anew from the venv after pyproject.toml's ranges change.
$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements.lock -e '.[dev,hf]'
	touch $@

install: $(VENV)/.installed

lock: install
	$(PY) -m pip freeze --exclude-editable | grep -v '^pip==' > requirements.lock

# PYTHONDONTWRITEBYTECODE= (empty: off) lets Python and pytest keep compiled and
# assert-rewritten modules in __pycache__ (ignored by git) where the environment turns that
# off: otherwise each run compiles the tests and the project again and rewrites some 400
# modules of the pytest plugins' packages (hypothesis, schemathesis, ...), 6 s of CPU.
# The fast set (no Ray, RLlib, browser or slow test) runs on TEST_WORKERS processes
# (pytest-xdist; `auto`: one per CPU): its tests share no cluster, port or file (each
# database test has its own table prefix). The rest -- the tests that start Ray clusters,
# build RLlib algorithms, drive a browser or take long -- run one at a time, as their
# module-scoped clusters and the machine's memory require. `make test` runs both, the
# second even when the first fails, and fails if either does.
TEST_WORKERS ?= auto
FAST := not ray and not rllib and not browser and not slow
test: install
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) -m "$(FAST)"; fast=$$?; \
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m "not ($(FAST))"; rest=$$?; \
	test $$fast -eq 0 -a $$rest -eq 0

test-fast: install
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) -m "$(FAST)"

demo: install
	$(VENV)/bin/pipeplan demo --model $(MODEL) --input-size $(INPUT_SIZE) --cluster $(CLUSTER) \
		--batch $(BATCH) --out $(OUT)

serve: install
	$(VENV)/bin/pipeplan serve $(SERVE_ARGS)

# mypy does not follow setuptools' package-dir: it checks a tree of links laid out as the
# installed package (build/typecheck/pipeplan/core -> core/, ...), with bench/ beside it.
TYPECHECK := build/typecheck
lint: install
	$(VENV)/bin/ruff check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/pipeplan
	cp pipeplan/__init__.py $(TYPECHECK)/pipeplan/
	for d in core models envs agents executor service; do ln -s ../../../$$d $(TYPECHECK)/pipeplan/$$d; done
	ln -s ../../bench $(TYPECHECK)/bench
	cd $(TYPECHECK) && $(abspath $(VENV))/bin/mypy --config-file ../../pyproject.toml

bench: install
	$(PY) -m bench.simulator_speed

# The docs extra (MkDocs, Material) once; then the generated pages (the CLI reference from
# the typer app, openapi.json and its routes table from the FastAPI app) and a strict,
# offline build.
$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q -c requirements.lock -e '.[docs]'
	touch $@

# DOCS_CHECK=--check (CI): fail when a generated page is out of date instead of rewriting it.
DOCS_CHECK ?=
docs: $(VENV)/.docs-installed
	$(PY) docs/gen_cli.py $(DOCS_CHECK)
	$(PY) docs/gen_api.py $(DOCS_CHECK)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

clean:
	rm -rf build
