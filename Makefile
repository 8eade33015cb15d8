# Two commands on a fresh machine: `make quickstart` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install quickstart test test-gpu lint bench clean

# Reinstall when the dependency list changes. constraints.txt pins torch so that no package pulls a CUDA build, and
# the triton whose interpreter runs Liger's kernels in the tests (the dev extra brings liger-kernel and triton).
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/finetune train examples/yaml/quickstart.yaml output_dir=runs/quickstart --overwrite

# The suite in TEST_WORKERS processes (pytest-xdist; worksteal evens out the long distributed and resume tests):
# on the 2-core CI machine about 6-7 minutes (5:52 for 3,206 tests on 2026-11-28; README, "Development").
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/ruff check finetune tests benchmarks scripts
	FINETUNE_TEST_ENV=require $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# On a CUDA machine: the whole suite with the gpu tests, bf16 LoRA and QLoRA CLI runs, the GPU benchmark (smoke);
# one verdict, exit 1 on failure or without CUDA. No install step: a GPU machine brings its own environment
# (../shared/gpu/README.md); .venv's python when there is one, else python3. STAGES=suite or STAGES=lora,qlora,liger,compile,bench
# runs a part (a GPU machine may limit one command's time).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	$(GPU_PY) scripts/test_gpu.py $(if $(STAGES),--only $(STAGES))

lint: $(STAMP)
	$(VENV)/bin/ruff check finetune tests benchmarks scripts

clean:
	rm -rf $(VENV) runs .pytest_cache
