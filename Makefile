# pipeplan: `make demo` runs the main job end to end; `make test` runs the tests.
# Both create .venv when it is missing and install the project into it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= build/demo
MODEL ?= alexnet
CLUSTER ?= examples/clusters/local-hetero.yaml

.PHONY: install test demo lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

demo: install
	mkdir -p $(OUT)
	$(VENV)/bin/pipeplan profile $(MODEL) --cluster $(CLUSTER) -o $(OUT)/$(MODEL).profile.json
	$(VENV)/bin/pipeplan validate $(CLUSTER)
	$(VENV)/bin/pipeplan simulate --profile $(OUT)/$(MODEL).profile.json --cluster $(CLUSTER) \
		--uniform 3 --batch 32 --microbatches 4 --save-plan $(OUT)/uniform.plan.json \
		--gantt $(OUT)/uniform.gantt.png

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: install
	$(PY) -m bench.simulator_speed

clean:
	rm -rf build
