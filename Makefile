# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when missing,
# installing the local CPU build of torch first so that nothing resolves a newer (CUDA) torch.
VENV ?= .venv
PY := $(VENV)/bin/python
PIPEC := $(VENV)/bin/pipec

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: test demo clean
test: $(VENV)/.installed
	$(PY) -m pytest -q

# Until the runtime lands: compile an example schedule and show it.
demo: $(VENV)/.installed
	$(PY) -m pipec compile --schedule 1f1b --pp 4 --microbatches 8 --out build/demo --force
	$(PY) -m pipec show build/demo --lines 8

clean:
	rm -rf $(VENV) build
