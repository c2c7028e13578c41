# nbgrader's autograder for the labs, to run with no network: the embedded model is
# converted at build time, so nothing is fetched when grading. From the repository root:
#   docker build -f docker/grader.Dockerfile -t minivllm/grader .
#   docker run --rm --network none minivllm/grader        (grades every lab's fixtures)
# Grading a class's submissions (a course root on a volume; each submission executed in a
# sandbox container of the learner image by docker/grade_sandbox.py): docker/README.md.
# The instructor's image: it holds labs/source (solutions, hidden tests); never a learner's.
# BASE_IMAGE: a stand-in for the public image where its registry is out of reach
# (scripts/build_base_image.sh).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# tini: PID 1 that forwards signals and reaps the kernels nbgrader starts.
# Debian's versions are not pinned: bookworm updates replace them, and a pin would break
# the build at the next security update; the python tag above pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

# jovyan (uid 1000), as in the lab images, so both can share the exchange and course volumes.
RUN useradd --create-home --uid 1000 --shell /bin/bash jovyan \
    && mkdir -p /opt/venv /opt/minivllm /opt/minivllm-cache /srv/nbgrader/exchange /srv/course \
    && chown jovyan:jovyan /opt/venv /opt/minivllm /opt/minivllm-cache /srv/course \
    && chmod 0777 /srv/nbgrader/exchange

ENV VENV=/opt/venv \
    MINIVLLM_CACHE=/opt/minivllm-cache \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY docker/nbgrader_config.py /etc/jupyter/

# jovyan, by number (a name may not resolve on the host: hadolint DL3066)
USER 1000:1000
WORKDIR /opt/minivllm
# What the install reads first (editable install: the packages' folders), the rest of the
# repository after it: an edit to the labs, tests or docs keeps the install's layer cached.
COPY --chown=1000:1000 pyproject.toml README.md ./
COPY --chown=1000:1000 scripts/install.sh scripts/
COPY --chown=1000:1000 minivllm minivllm
COPY --chown=1000:1000 minivllm_kernels minivllm_kernels
COPY --chown=1000:1000 grading grading

# The one install procedure (scripts/install.sh): CPU torch, the course extra (nbgrader,
# jupytext, the kernel) and the embedded model converted into MINIVLLM_CACHE.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=course
RUN scripts/install.sh --model "$VENV" \
    && rm -rf "$MINIVLLM_CACHE/wheels"
COPY --chown=1000:1000 . .

# From here on nothing may need the network: no hub look-ups, no pip.
# OMP_WAIT_POLICY=PASSIVE: torch's threads sleep rather than spin while they wait, as
# `python -m grading.grade` sets for its kernels (grading/grade.py, KERNEL_ENV): a correct
# solution then fits the timeout on a busy grader.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PIP_NO_INDEX=1 \
    OMP_WAIT_POLICY=PASSIVE

ENTRYPOINT ["tini", "--"]
CMD ["python", "-m", "grading.grade"]
