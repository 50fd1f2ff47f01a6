# Two commands for a reader:
#   make book    set up .venv (first time, or when requirements.txt changed) and build the site
#   make test    the same set-up and build, then the whole test suite (pytest)
# Other targets: make venv (set-up only), make clean (remove the build), make distclean
# (remove the build and .venv), make mutants (mutation testing of attnlib's core modules,
# not part of make test: see CONTRIBUTING.md). Python 3.11, 3.12 and 3.13 are supported: make takes the
# first of python3.13, python3.12, python3.11 that runs; override it with
# PYTHON=/path/to/python3.12, pass extra pip options with PIP_ARGS="..." (e.g. an extra index)
# and extra pytest options with PYTEST_ARGS="..." (e.g. -x, or --durations=15).

SUPPORTED := python3.13 python3.12 python3.11
# `-c ''` as well as `command -v`: a pyenv shim exists for every installed version but
# runs only the selected ones.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(or $(firstword $(foreach p,$(SUPPORTED),$(shell $(p) -c '' >/dev/null 2>&1 && echo $(p)))),python3.13)
endif
PIP_ARGS ?=
PYTEST_ARGS ?=
VENV := .venv
BIN := $(VENV)/bin
# Written after a successful install; newer than requirements.txt and pyproject.toml
# means nothing to reinstall.
STAMP := $(VENV)/.requirements-installed
LOG := $(VENV)/pip-install.log

.PHONY: book test venv clean distclean help mutants
.DEFAULT_GOAL := help

help:
	@echo "make book   set up .venv if needed and build the book into _build/html"
	@echo "make test   set up .venv if needed and run the tests (pytest)"
	@echo "make clean  remove _build;  make distclean  also remove .venv"
	@echo "make mutants  mutation testing of attnlib's core modules (hours; see CONTRIBUTING.md)"

# What the HTML is built from (the browser tests name the same list): the book is
# rebuilt when one of them is newer than the last good build.
HTML := _build/html
BOOK_SOURCES := $(wildcard _config.yml _toc.yml *.md references.bib chapters/*.ipynb attnlib/*/*.py \
                attnlib/*.py _static/* _ext/*.py images/*)

book: $(HTML)/index.html
	@echo "The book is in $(HTML): open $(HTML)/index.html in a browser."

# A failed build (a warning is an error) removes index.html, so that the next make
# builds again instead of taking a half-written site for a good one. --all: every page is
# written and every warning shown each time, and the static files (CSS, explorers.js)
# are copied even when no page changed.
$(HTML)/index.html: $(BOOK_SOURCES) $(STAMP)
	$(BIN)/jupyter-book build . --all -W -n --keep-going || { rm -f $@; exit 1; }
	@touch $@

# The browser tests read the build that `make book` made (ATTNLIB_BOOK_HTML) rather
# than building the book a second time.
test: $(HTML)/index.html
	ATTNLIB_BOOK_HTML=$(HTML) $(BIN)/python -m pytest $(PYTEST_ARGS)

venv: $(STAMP)

# A supported Python (3.11 to 3.13), checked before anything is created, so a wrong or
# missing interpreter stops with what to do rather than a traceback.
SUPPORTED_CHECK := import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))
$(BIN)/python:
	@$(PYTHON) -c '' >/dev/null 2>&1 || { \
	  echo ""; \
	  echo "make: this book needs Python 3.11, 3.12 or 3.13, and '$(PYTHON)' was not found (or does not run)."; \
	  echo "  Install one, e.g. Debian/Ubuntu: sudo apt-get install python3 python3-venv (Debian 12: 3.11, 13: 3.13)"; \
	  echo "                   macOS (Homebrew): brew install python@3.13"; \
	  echo "                   or with uv: uv python install 3.13"; \
	  echo "  or point make at one: make book PYTHON=/path/to/python3.12"; \
	  exit 1; }
	@$(PYTHON) -c '$(SUPPORTED_CHECK)' || { \
	  echo ""; \
	  echo "make: '$(PYTHON)' is Python $$($(PYTHON) -c 'import platform; print(platform.python_version())'), the book needs 3.11, 3.12 or 3.13."; \
	  echo "  Run: make book PYTHON=/path/to/python3.13"; \
	  exit 1; }
	@echo "Creating $(VENV) with $$($(PYTHON) -c 'import sys; print(sys.executable)') ..."
	@$(PYTHON) -m venv $(VENV) >/dev/null 2>&1 || { \
	  rm -rf $(VENV); \
	  echo ""; \
	  echo "make: could not create a virtual environment with $(PYTHON)."; \
	  echo "  On Debian/Ubuntu the venv module is a separate package: sudo apt-get install python3-venv"; \
	  exit 1; }

# Reinstalled only when requirements.txt or pyproject.toml (attnlib's dependencies)
# changed since the last successful install.
$(STAMP): requirements.txt pyproject.toml | $(BIN)/python
	@$(BIN)/python -c '$(SUPPORTED_CHECK)' || { \
	  echo ""; \
	  echo "make: $(VENV) was made with a Python other than 3.11 to 3.13. Remove it and run make again:"; \
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
	rm -rf $(VENV) $(MUTANTS_VENV) .mutants

# ---- make mutants: mutation testing (scripts/mutants.py), not part of make test ----------
# Its own environment, .venv-mutants: requirements.txt without its `-e .` line, plus mutmut,
# so that attnlib is not installed there and the tests can only import mutmut's mutated copy
# (the script checks it). MUTANTS_ARGS passes arguments to the script, e.g.
#   make mutants MUTANTS_ARGS="attention rounding --jobs 1"
MUTMUT := mutmut==3.8.1
MUTANTS_VENV := .venv-mutants
MUTANTS_STAMP := $(MUTANTS_VENV)/.requirements-installed
MUTANTS_ARGS ?=

$(MUTANTS_STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c '$(SUPPORTED_CHECK)' || { echo "make: mutants need Python 3.11 to 3.13 (PYTHON=...)"; exit 1; }
	@[ -x $(MUTANTS_VENV)/bin/python ] || $(PYTHON) -m venv $(MUTANTS_VENV)
	@grep -v '^-e ' requirements.txt > $(MUTANTS_VENV)/requirements.txt
	@echo "Installing requirements.txt (without attnlib) and $(MUTMUT) into $(MUTANTS_VENV) ..."
	@PIP_DISABLE_PIP_VERSION_CHECK=1 $(MUTANTS_VENV)/bin/python -m pip install -r $(MUTANTS_VENV)/requirements.txt \
	  $(MUTMUT) $(PIP_ARGS) > $(MUTANTS_VENV)/pip-install.log 2>&1 || { \
	  tail -n 15 $(MUTANTS_VENV)/pip-install.log; echo "make: installing into $(MUTANTS_VENV) failed"; exit 1; }
	@touch $@

mutants: $(MUTANTS_STAMP)
	$(MUTANTS_VENV)/bin/python scripts/mutants.py $(MUTANTS_ARGS)
