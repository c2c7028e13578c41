# minivllm / precision course: the front door.
#   make demo   fetch + convert the embedded model (first run), measure KV-cache dtypes
#               against the float32 reference (the first incident)
#   make test   the test suite (what CI runs; includes the chapter notebooks and the
#               nbgrader labs graded both ways)
#   make lab    JupyterLab on the course, with nbgrader's extensions
#   make grade  generate, validate and autograde every lab against its fixtures
# Each creates .venv and installs on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch pinned to the CPU build this project is tested with; override on a GPU box,
# e.g. make install TORCH_SPEC="torch>=2.5".
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

LAB_PORT ?= 8888

.PHONY: install demo test test-fast lab grade clean help

help:
	@echo "make demo | make test | make lab | make grade | make install | make test-fast | make clean"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,course,serve]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m minivllm.entrypoints.cli demo

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not embedded" $(PYTEST_ARGS)

# JupyterLab refuses to run as root unless told (containers run as root).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: install
	$(PY) -m minivllm.models.embedded
	$(PY) -m grading.grade --prepare-only
	$(VENV)/bin/jupyter lab --port $(LAB_PORT) --notebook-dir . $(ALLOW_ROOT)

grade: install
	$(PY) -m grading.grade

clean:
	rm -rf $(VENV) .pytest_cache reports build *.egg-info
