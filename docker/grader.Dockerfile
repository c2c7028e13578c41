# nbgrader's autograder for the labs, to run with no network: the embedded model is
# converted at build time, so nothing is fetched when grading. From the repository root:
#   docker build -f docker/grader.Dockerfile -t minivllm/grader .
#   docker run --rm --network none minivllm/grader        (grades every lab's fixtures)
# Grading a class's submissions (a course root on a volume): docker/README.md.
FROM python:3.11-slim-bookworm

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
COPY --chown=1000:1000 . .

# The one install procedure (scripts/install.sh): CPU torch, the course extra (nbgrader,
# jupytext, the kernel) and the embedded model converted into MINIVLLM_CACHE.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=course
RUN scripts/install.sh --model "$VENV" \
    && rm -rf "$MINIVLLM_CACHE/wheels"

# From here on nothing may need the network: no hub look-ups, no pip.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PIP_NO_INDEX=1

ENTRYPOINT ["tini", "--"]
CMD ["python", "-m", "grading.grade"]
