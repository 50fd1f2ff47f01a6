# Two commands for a reader:
#   make book    set up .venv (first time, or when requirements.txt changed) and build the site
#   make test    the same set-up, then the whole test suite (pytest)
# Other targets: make venv (set-up only), make clean (remove the build), make distclean
# (remove the build and .venv). Override the interpreter with PYTHON=/path/to/python3.11
# and pass extra pip options with PIP_ARGS="..." (e.g. an extra index).

PYTHON ?= python3.11
PIP_ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
# Written after a successful install; newer than requirements.txt and pyproject.toml
# means nothing to reinstall.
STAMP := $(VENV)/.requirements-installed
LOG := $(VENV)/pip-install.log

.PHONY: book test venv clean distclean help
.DEFAULT_GOAL := help

help:
	@echo "make book   set up .venv if needed and build the book into _build/html"
	@echo "make test   set up .venv if needed and run the tests (pytest)"
	@echo "make clean  remove _build;  make distclean  also remove .venv"

book: $(STAMP)
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "The book is in _build/html: open _build/html/index.html in a browser."

test: $(STAMP)
	$(BIN)/python -m pytest

venv: $(STAMP)

# Python 3.11, checked before anything is created, so a wrong or missing interpreter
# stops with what to do rather than a traceback.
$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { \
	  echo ""; \
	  echo "make: this book needs Python 3.11, and '$(PYTHON)' was not found."; \
	  echo "  Install it, e.g. Debian/Ubuntu: sudo apt-get install python3.11 python3.11-venv"; \
	  echo "                   macOS (Homebrew): brew install python@3.11"; \
	  echo "                   or with uv: uv python install 3.11"; \
	  echo "  or point make at one: make book PYTHON=/path/to/python3.11"; \
	  exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { \
	  echo ""; \
	  echo "make: '$(PYTHON)' is Python $$($(PYTHON) -c 'import platform; print(platform.python_version())'), the book needs 3.11."; \
	  echo "  Run: make book PYTHON=/path/to/python3.11"; \
	  exit 1; }
	@echo "Creating $(VENV) with $$($(PYTHON) -c 'import sys; print(sys.executable)') ..."
	@$(PYTHON) -m venv $(VENV) >/dev/null 2>&1 || { \
	  rm -rf $(VENV); \
	  echo ""; \
	  echo "make: could not create a virtual environment with $(PYTHON)."; \
	  echo "  On Debian/Ubuntu the venv module is a separate package: sudo apt-get install python3.11-venv"; \
	  exit 1; }

# Reinstalled only when requirements.txt or pyproject.toml (attnlib's dependencies)
# changed since the last successful install.
$(STAMP): requirements.txt pyproject.toml | $(BIN)/python
	@$(BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { \
	  echo ""; \
	  echo "make: $(VENV) was made with another Python than 3.11. Remove it and run make again:"; \
	  echo "  rm -rf $(VENV) && make book"; \
	  exit 1; }
	@echo "Installing requirements.txt into $(VENV) (the first time takes a few minutes) ..."
	@PIP_DISABLE_PIP_VERSION_CHECK=1 $(BIN)/python -m pip install -r requirements.txt $(PIP_ARGS) >$(LOG) 2>&1 || { \
	  tail -n 15 $(LOG); \
	  echo ""; \
	  echo "make: installing requirements.txt failed; the lines above are the end of $(LOG)."; \
	  echo "  Check the network connection (pip needs to reach PyPI) and the disk space,"; \
	  echo "  then run make again: it retries the install."; \
	  exit 1; }
	@touch $@
	@echo "Installed (log: $(LOG))."

clean:
	rm -rf _build

distclean: clean
	rm -rf $(VENV)
