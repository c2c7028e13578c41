# minivllm / precision course: the front door.
#   make demo   fetch + convert the embedded model (first run), measure KV-cache dtypes
#               against the float32 reference (the first incident)
#   make test   the test suite (what CI runs; includes the chapter notebooks and the
#               nbgrader labs graded both ways)
#   make lab    JupyterLab on the course, with nbgrader's extensions: the labs released to
#               the Assignment List, the Formgrader on build/nbgrader (grades kept between starts);
#               COURSE_LANG=zh releases them with Chinese instructions
#   make grade  autograde every lab against CI's fixtures (solution, released copy, the
#               lab's own wrong answers; the generic ones for ch01/ch02), exact scores
#   make grade-all  every lab against EVERY fixture, the generic ones too (exception,
#               infinite loop, NaN, patched checks): run it before calling a lab done
#   make mutants  mutation testing of the labs' graders (grading/mutants.py): mutants of each
#               solution, how many the tests kill; writes reports/mutation/<lab>.json.
#               LABS="ch01 ch03" for some labs (default: all 30; each must kill
#               >= 90 % of its non-equivalent mutants)
#   make course-isa  the chapters executed as an AVX2 CPU (PyTorch, oneDNN and MKL kernels
#               capped at AVX2 on an AVX-512/AMX machine), copies in reports/course-avx2/:
#               read them beside reports/course/ (CHAPTERS="ch05 or ch12" for some);
#               `python scripts/course_profiles.py stale|claims` lists the copies to run
#               again and the claims rows whose verdicts differ between the profiles
#   make lint-docker  hadolint on the images in docker/
#   make classroom-test  the class's round trips, timed, with the learners' scores: make lab's
#               setup, the Kubernetes values (schema, roles, per-user uids), the images
#               (learners' sessions as their own uids, the sandboxed grader) and both
#               JupyterHub setups (local accounts; containers), one learner in Chromium;
#               builds the images first where `docker info` works (else those tests skip)
#   make classroom-images  the learner, instructor and grader images classroom-test runs
#               (BASE_IMAGE, TORCH_WHEEL=/path/torch.whl offline: docker/README.md)
#   make site   the course website into build/site (mkdocs build --strict)
# Each creates .venv and installs on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch pinned to the CPU build this project is tested with; override on a GPU box,
# e.g. make install TORCH_SPEC="torch>=2.5".
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,course,serve,docs
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (auto: one per core, at most 4; tests/conftest.py
# says how the work is split). PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= auto

LAB_PORT ?= 8888
# The language of the labs' instructions for make lab / grade / grade-all: en, or zh (the
# Chinese edition: docs/i18n.py; the same assignments, cells, points and tests).
COURSE_LANG ?= en

.PHONY: install demo test test-fast lab grade grade-all mutants course-isa lint-docker site clean help quantized classroom-test classroom-images

help:
	@echo "make demo | make test | make lab | make grade | make grade-all | make mutants | make course-isa | make classroom-test | make classroom-images | make install | make test-fast | make lint-docker | make site | make clean"
	@echo "  grade: every lab against CI's fixtures; grade-all: every fixture of every lab (before a lab is done)"

# scripts/install.sh is the one install procedure (CI and the Docker images run it too);
# it creates the venv, installs torch and `pip install -e ".[$(EXTRAS)]"`, and touches the stamp.
$(VENV)/.installed: pyproject.toml scripts/install.sh
	PYTHON="$(PYTHON)" TORCH_SPEC="$(TORCH_SPEC)" EXTRAS="$(EXTRAS)" scripts/install.sh $(VENV)

install: $(VENV)/.installed

demo: install
	$(PY) -m minivllm.entrypoints.cli demo

# The quantized checkpoints the chapters load, built once and cached beside the converted
# model (minivllm.quantization.checkpoint.cached_quantized; chapter 15's AWQ g128, chapter
# 16's two GPTQ g128 (AutoGPTQ's defaults and the engine's), chapter 17's fp8 static
# checkpoint, chapter 28's int8 and fp8 dynamic). A chapter that finds none builds it on
# first use; this builds them ahead (about a minute each on 2 cores).
quantized: install
	$(PY) -m minivllm.quantization.checkpoint awq '{"group_size": 128, "symmetric": false, "clip": false, "calibration_tokens": 1024}'
	$(PY) -m minivllm.quantization.checkpoint gptq '{"group_size": 128, "symmetric": true, "act_order": false, "percdamp": 0.01}'
	$(PY) -m minivllm.quantization.checkpoint gptq '{"group_size": 128, "symmetric": true, "act_order": true, "percdamp": 1.0}'
	$(PY) -m minivllm.quantization.checkpoint fp8 '{"activation_scheme": "static"}'
	$(PY) -m minivllm.quantization.checkpoint int8
	$(PY) -m minivllm.quantization.checkpoint fp8

# the quantized checkpoints first: a chapter's time then excludes their one-time build
test: install quantized
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not embedded" $(PYTEST_ARGS)

# JupyterLab refuses to run as root unless told (containers run as root).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

# The class on one machine (nbgrader_config.py): the course root build/nbgrader (gradebook,
# submissions, feedback: kept from one start to the next), the exchange build/exchange, the
# learner's folder build/labs. Only labs changed since their release are released again.
lab: install
	@echo "make lab 1/3: the embedded model (fetched and converted on the first run, then cached)"
	$(PY) -m minivllm.models.embedded
	@echo "make lab 2/3: the labs (the first run releases all 30, under a minute; later only labs whose source changed)"
	$(PY) -m grading.grade --prepare-only --lang $(COURSE_LANG)
	@echo "make lab 3/3: JupyterLab on port $(LAB_PORT): open the http://127.0.0.1:$(LAB_PORT)/lab?token=... URL it prints;"
	@echo "  Nbgrader > Assignment List (learner: fetch, validate, submit), Nbgrader > Formgrader (instructor);"
	@echo "  instructor commands: docs/instructor.md (grades and submissions stay in build/nbgrader)"
	$(VENV)/bin/jupyter lab --port $(LAB_PORT) --notebook-dir . $(ALLOW_ROOT)

# GRADE_ARGS: e.g. GRADE_ARGS="ch03" (one lab) or GRADE_ARGS="--load 2 ch01" (under load).
GRADE_ARGS ?=

grade: install
	$(PY) -m grading.grade --lang $(COURSE_LANG) $(GRADE_ARGS)

grade-all: install
	$(PY) -m grading.grade --all --lang $(COURSE_LANG) $(GRADE_ARGS)

# LABS: the labs whose graders are measured (every record is checked, every lab gated).
LABS ?= ch01 ch02 ch03 ch04 ch05 ch06 ch07 ch08 ch09 ch10 ch11 ch12 ch13 ch14 ch15 \
	ch16 ch17 ch18 ch19 ch20 ch21 ch22 ch23 ch24 ch25 ch26 ch27 ch28 ch29 ch30

mutants: install
	$(PY) -m minivllm.models.embedded
	$(PY) -m grading.mutants $(LABS)

# A second CPU: the same machine with its vector kernels capped at AVX2 (CI lands on any
# x86 CPU; a chapter's prose must hold under both). Not part of `make test`.
# CHAPTERS: a pytest -k expression over chapter folder names (default: chapters 1-15).
CHAPTERS ?= ch01_ or ch02_ or ch03_ or ch04_ or ch05_ or ch06_ or ch07_ or ch08_ or ch09_ or \
	ch10_ or ch11_ or ch12_ or ch13_ or ch14_ or ch15_
ISA_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2

course-isa: install quantized
	$(ISA_ENV) MINIVLLM_COURSE_OUT=reports/course-avx2 $(PY) -m pytest -q -s -n 0 \
		tests/test_course.py -k "test_chapter_executes and ($(CHAPTERS))" $(PYTEST_ARGS)

# hadolint (from the dev extra) on every image; must pass clean.
lint-docker: install
	$(VENV)/bin/hadolint docker/*.Dockerfile

# The class's round trips, timed, with the scores of two learners (a wrong, late submission
# and a correct one): the one-machine setup of `make lab` (tests/test_classroom.py:
# fetch, submit, collect, autograde, feedback per learner, late penalty, export, restart),
# the hub's Kubernetes values (tests/test_z2jh_values.py, schema and roles only), and the
# images (tests/test_classroom_docker.py: learners' sessions in the learner image as uids of
# their own, the exchange, the grader with each submission sandboxed by
# docker/grade_sandbox.py, the integrity attempts; needs a Docker engine and the images
# built as docker/README.md says, else it skips with the reason), and the two JupyterHub
# setups (tests/test_classroom_hub.py: docker/local_hub/jupyterhub_config.py, learners as
# Unix accounts, and docker/jupyterhub_config.py, learners' containers as uids of their own;
# two learners and an instructor through each hub, one in Chromium, the integrity attempts
# from a learner's terminal; needs root, jupyterhub and configurable-http-proxy, and for the
# second Docker and the images, else it skips with the reason). It adds Unix accounts and a
# group while it runs and removes them: MINIVLLM_CLASSROOM_HUB=1, here only. The hubs need
# the hub-docker extra (jupyterhub, dockerspawner): scripts/install.sh --extras
# dev,course,serve,docs,hub-docker .venv. Where `docker info` works it first builds the
# images (classroom-images: seconds when nothing changed; minutes an image after an edit
# to what the install copies, docker/README.md).
classroom-test: install
	@if docker info >/dev/null 2>&1; then $(MAKE) --no-print-directory classroom-images; \
	else echo "classroom-test: docker info failed (no Docker engine): the image and Docker hub tests skip"; fi
	$(PY) -m minivllm.models.embedded
	MINIVLLM_CLASSROOM_HUB=1 $(PY) -m pytest -q -s -n 0 --durations=0 tests/test_classroom.py \
		tests/test_z2jh_values.py tests/test_classroom_docker.py tests/test_classroom_hub.py

# The images make classroom-test runs, built one after the other with Docker's layer cache
# (scripts/build_classroom_images.sh; docker/README.md, "The class's images in one
# command"): the learner image, the instructor image (lab-cpu --target instructor) and the
# grader. BASE_IMAGE: their base (unset: python:3.11-slim-bookworm, else the offline
# stand-in that scripts/build_base_image.sh builds); TORCH_WHEEL: a torch wheel file served
# to the builds from this host where PyTorch's index is out of reach; CLASSROOM_IMAGES:
# some of learner, instructor, grader.
CLASSROOM_IMAGES ?= learner instructor grader
classroom-images:
	BASE_IMAGE="$(BASE_IMAGE)" TORCH_WHEEL="$(TORCH_WHEEL)" scripts/build_classroom_images.sh $(CLASSROOM_IMAGES)

# The course website: chapters executed on first build (about a minute each; cached in
# build/notebooks until a chapter or the engine changes), then mkdocs with no warnings.
site: install
	$(PY) -m minivllm.models.embedded
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

# reports/course_times.json and reports/mutation/ are committed records: kept
clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
	git clean -fdqX reports 2>/dev/null || true
