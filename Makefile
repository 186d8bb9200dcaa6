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

# The main job: compile a byte-level GPT for 4 ranks and train it on the Shakespeare shipped in
# examples/data/ under torchrun (CPU): the loss falls from ln 256 = 5.55; a checkpoint at the end.
demo: $(VENV)/.installed
	$(PY) examples/demo.py

clean:
	rm -rf $(VENV) build
