# minivllm / precision course: the front door.
#   make demo   fetch + convert the embedded model (first run), run the first incident
#   make test   the test suite (what CI runs)
# Both create .venv and install on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch pinned to the CPU build this project is tested with; override on a GPU box,
# e.g. make install TORCH_SPEC="torch>=2.5".
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install demo test test-fast clean help

help:
	@echo "make demo | make test | make install | make test-fast | make clean"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m minivllm.entrypoints.cli demo

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not embedded" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache reports build *.egg-info
