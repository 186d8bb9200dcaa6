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

.PHONY: test demo clean gpu-check
test: $(VENV)/.installed
	$(PY) -m pytest -q

# The main job: compile a byte-level GPT for 4 ranks and train it on the Shakespeare shipped in
# examples/data/ under torchrun (CPU): the loss falls from ln 256 = 5.55; a checkpoint at the end.
demo: $(VENV)/.installed
	$(PY) examples/demo.py

# On the GPU machine: the kernel's tests and speed on CUDA, the runtime on CUDA, and the 4-rank CPU
# figures (bench/gpu_check.py). Without CUDA it says what it skipped and exits 0. It installs
# nothing: .venv's Python when there is one, else python3 (the GPU image's, which has torch).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PY) bench/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) build
