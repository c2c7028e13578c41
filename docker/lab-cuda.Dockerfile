# The course in JupyterLab on an NVIDIA GPU: as lab-cpu.Dockerfile, on a CUDA runtime base
# with CUDA torch; the Triton kernels compile for the GPU (gcc and Python headers are for
# Triton's launcher). From the repository root:
#   docker build -f docker/lab-cuda.Dockerfile -t minivllm/lab-cuda .          (learners)
#   docker run --rm --gpus all -p 8888:8888 minivllm/lab-cuda
#   docker build -f docker/lab-cuda.Dockerfile --target instructor -t minivllm/lab-cuda-instructor .
# Needs the NVIDIA Container Toolkit on the host and a driver for CUDA 12.8 or newer.
# Two images as in lab-cpu.Dockerfile: the learner image (the default) has no labs/source,
# grading fixtures or tests; the instructor image is the whole repository (`make lab`).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# instructor: the whole repository, `make lab`; the learner stage copies from it.
FROM ${BASE_IMAGE} AS instructor

# python3 (3.12 on Ubuntu 24.04) with venv and headers, gcc for Triton, make for `make lab`,
# tini as PID 1. Ubuntu's versions are not pinned: updates replace them, and a pin would
# break the build at the next security update; the base tag pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev make tini \
    && rm -rf /var/lib/apt/lists/*

# jovyan (uid 1000): the user DockerSpawner expects; Ubuntu's images ship `ubuntu` with
# that uid, so it goes first.
RUN userdel --remove ubuntu \
    && useradd --create-home --uid 1000 --shell /bin/bash jovyan \
    && mkdir -p /opt/venv /opt/minivllm /opt/minivllm-cache /opt/minivllm-release \
        /srv/nbgrader/exchange /home/jovyan/work \
    && chown jovyan:jovyan /opt/venv /opt/minivllm /opt/minivllm-cache /opt/minivllm-release \
        /home/jovyan/work \
    && chmod 0777 /srv/nbgrader/exchange

ENV VENV=/opt/venv \
    MINIVLLM_CACHE=/opt/minivllm-cache \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY docker/jupyter_server_config.py docker/nbgrader_config.py /etc/jupyter/

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

# The one install procedure (scripts/install.sh): torch built for CUDA 12.8 from PyTorch's
# index (any torch >= 2.5 the index has; pin with --build-arg TORCH_SPEC=torch==X.Y.Z),
# the course, serve and hub extras, and the embedded model converted into MINIVLLM_CACHE.
ARG TORCH_SPEC=torch>=2.5
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG EXTRAS=course,serve,hub
RUN scripts/install.sh --model "$VENV" \
    && rm -rf "$MINIVLLM_CACHE/wheels"
COPY --chown=1000:1000 . .

# The labs as learners get them (solutions stubbed, hidden tests removed): release/ only
# goes into the learner stage. COURSE_LANG=zh: the Chinese edition.
ARG COURSE_LANG=en
RUN python -m grading.grade --prepare-only --lang "$COURSE_LANG" \
        --course-root /tmp/release-course --exchange /tmp/release-exchange \
    && cp -r /tmp/release-course/release/. /opt/minivllm-release/ \
    && rm -rf /tmp/release-course /tmp/release-exchange

EXPOSE 8888
ENTRYPOINT ["tini", "--"]
CMD ["make", "lab"]

# learner (the default target): the engine, the chapters, the released labs and
# grading/checks.py, as in lab-cpu.Dockerfile; python3 (the virtualenv's interpreter),
# gcc, libc headers and Python headers (Triton compiles its launcher at run time), tini.
FROM ${BASE_IMAGE} AS learner

# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-dev gcc libc6-dev tini \
    && rm -rf /var/lib/apt/lists/*

RUN userdel --remove ubuntu \
    && useradd --create-home --uid 1000 --shell /bin/bash jovyan \
    && mkdir -p /opt/minivllm/labs /opt/minivllm/grading /srv/nbgrader/exchange /home/jovyan/work \
    && chown jovyan:jovyan /home/jovyan/work \
    && chmod 0777 /srv/nbgrader/exchange \
    && ln -s /opt/minivllm /home/jovyan/work/minivllm-course

ENV VENV=/opt/venv \
    MINIVLLM_CACHE=/opt/minivllm-cache \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

COPY docker/jupyter_server_config.py docker/nbgrader_config.py /etc/jupyter/
COPY --from=instructor --chown=0:0 /opt/venv /opt/venv
COPY --from=instructor --chown=0:0 /opt/minivllm-cache /opt/minivllm-cache
COPY pyproject.toml /opt/minivllm/
COPY minivllm /opt/minivllm/minivllm
COPY minivllm_kernels /opt/minivllm/minivllm_kernels
COPY course /opt/minivllm/course
COPY grading/__init__.py grading/checks.py /opt/minivllm/grading/
COPY --from=instructor --chown=0:0 /opt/minivllm-release /opt/minivllm/labs

# The entrypoint after tini: the learner's link to the course (minivllm-course, not
# minivllm: that name would shadow the package in the home folder) and a model cache the
# learner may write (MINIVLLM_CACHE in the home, its models a link to /opt/minivllm-cache's),
# for any uid (docker/learner-start.sh).
COPY docker/learner-start.sh /usr/local/bin/minivllm-learner-start

USER 1000:1000
WORKDIR /home/jovyan/work
EXPOSE 8888
ENTRYPOINT ["tini", "--", "minivllm-learner-start"]
CMD ["jupyter", "lab", "--ServerApp.root_dir=/home/jovyan/work"]
