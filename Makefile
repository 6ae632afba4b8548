# Set-up and everyday commands. Needs only Python >= 3.10 (3.11 recommended) on the PATH.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint unit bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)  ## explain the embedded seed model
	$(BIN)/gradscope explain

lint: $(STAMP)
	$(BIN)/ruff check gradscope tests bench
	$(BIN)/mypy gradscope

unit: $(STAMP)
	$(BIN)/pytest

test: lint unit  ## the whole suite, as CI runs it

bench: $(STAMP)
	$(BIN)/python bench/explain_latency.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
