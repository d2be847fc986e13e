# Every target works on a fresh machine: it creates a local virtualenv (.venv) and installs the package
# into it, editable, the first time, and again whenever pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup train test check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# an existing nanoeuler.bin is never replaced unasked: OVERWRITE=1 starts afresh over it
train: $(STAMP)
	@if [ -f nanoeuler.bin ] && [ -z "$(OVERWRITE)" ]; then echo "make train: nanoeuler.bin exists and is kept;" \
		"continue it with '.venv/bin/nanoeuler train --resume', or start afresh with 'make train OVERWRITE=1'"; exit 2; fi
	$(PY) -m nanoeuler train small --data shakespeare.txt $(if $(OVERWRITE),--overwrite)

check: $(STAMP)
	$(PY) -m nanoeuler check

# strict: a skipped test fails the run unless it is marked gpu (tests/conftest.py); STRICT_SKIPS=0 lifts that
STRICT_SKIPS ?= 1
test: $(STAMP)
	NANOEULER_STRICT_SKIPS=$(STRICT_SKIPS) $(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
