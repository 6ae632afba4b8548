# Set-up and everyday commands. Needs only Python >= 3.10 (3.11 recommended) on the PATH.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint unit bench clean

# Every extra (plot, notebook, tensorboard) and the test tools, so that each feature works
# right after `make demo`. A .venv made before the distribution was renamed to gradscope-rnn
# holds it as "gradscope" (or holds the unrelated project of that name): that goes first.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if $(BIN)/python -m pip show --quiet gradscope >/dev/null 2>&1; then \
	    $(BIN)/python -m pip uninstall --quiet --disable-pip-version-check -y gradscope; fi
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[all,test]'
	@# pip byte-compiles a regular install, not an editable one: do it here, so that a run
	@# does not compile gradscope's modules from source each time (PYTHONDONTWRITEBYTECODE).
	$(BIN)/python -m compileall -q gradscope
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)  ## explain the embedded seed model
	$(BIN)/gradscope explain

lint: $(STAMP)
	$(BIN)/ruff check gradscope tests bench
	$(BIN)/mypy gradscope

unit: $(STAMP)  ## the tests, on every core (one worker per test module)
	$(BIN)/pytest -n auto --dist loadscope

test: lint unit  ## the whole suite, as CI runs it

bench: $(STAMP)
	$(BIN)/python bench/explain_latency.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
