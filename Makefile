# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when missing,
# installing the local CPU build of torch first so that nothing resolves a newer (CUDA) torch.
VENV ?= .venv
PY := $(VENV)/bin/python
PIPEC := $(VENV)/bin/pipec

# torchtitan (tests/test_torchtitan.py runs pipec's exported settings in it): pinned, and installed
# with --no-deps, which a pyproject extra cannot say, so that pip resolves no other torch. The
# packages torchtitan imports on the tests' path come second, with their own (torch-free)
# dependencies; Hugging Face's datasets is left out (tests/torchtitan_stubs/ stands in for it).
TORCHTITAN := torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 torchdata==0.11.0
TORCHTITAN_IMPORTS := tyro==1.0.17 einops==0.8.2

# pip prints each package as it comes; the sizes below are what each step puts on disk
# (measured with du on a finished .venv's site-packages).
$(VENV)/.installed: pyproject.toml Makefile
	@echo "pipec: creating $(VENV): about 2.3 GB on disk in 4 steps, a few minutes"
	test -x $(PY) || python3 -m venv $(VENV)
	@echo "pipec: [1/4] upgrading pip (~10 MB)"
	$(PY) -m pip install --upgrade pip
	@echo "pipec: [2/4] installing torch 2.13.0, the CPU build, with sympy and networkx (~870 MB)"
	$(PY) -m pip install torch==2.13.0
	@echo "pipec: [3/4] installing pipec (jinja2, click, safetensors) and what the tests use:" \
	    "triton (~1 GB, the attention kernel's interpreter), numpy, pytest, hypothesis, ruff," \
	    "transformers and tensorboard (~250 MB)"
	$(PY) -m pip install -e '.[test]'
	@echo "pipec: [4/4] installing torchtitan for the tests without its CUDA dependencies," \
	    "then the pure-Python packages it imports (~18 MB): $(TORCHTITAN) $(TORCHTITAN_IMPORTS)"
	$(PY) -m pip install --no-deps $(TORCHTITAN)
	$(PY) -m pip install $(TORCHTITAN_IMPORTS)
	@echo "pipec: $(VENV) is ready ($$(du -sh $(VENV) | cut -f1)); the command is $(PIPEC)"
	touch $@

.PHONY: test demo clean gpu-check
# The suite writes only to temporary directories; pytest lists its slowest tests after each run.
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
