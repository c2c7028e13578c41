# The course in JupyterLab on an NVIDIA GPU: as lab-cpu.Dockerfile, on a CUDA runtime base
# with CUDA torch; the Triton kernels compile for the GPU (gcc and Python headers are for
# Triton's launcher). From the repository root:
#   docker build -f docker/lab-cuda.Dockerfile -t minivllm/lab-cuda .
#   docker run --rm --gpus all -p 8888:8888 minivllm/lab-cuda
# Needs the NVIDIA Container Toolkit on the host and a driver for CUDA 12.8 or newer.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

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
    && mkdir -p /opt/venv /opt/minivllm /opt/minivllm-cache /srv/nbgrader/exchange /home/jovyan/work \
    && chown jovyan:jovyan /opt/venv /opt/minivllm /opt/minivllm-cache /home/jovyan/work \
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
COPY --chown=1000:1000 . .

# The one install procedure (scripts/install.sh): torch built for CUDA 12.8 from PyTorch's
# index (any torch >= 2.5 the index has; pin with --build-arg TORCH_SPEC=torch==X.Y.Z),
# the course, serve and hub extras, and the embedded model converted into MINIVLLM_CACHE.
ARG TORCH_SPEC=torch>=2.5
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG EXTRAS=course,serve,hub
RUN scripts/install.sh --model "$VENV" \
    && rm -rf "$MINIVLLM_CACHE/wheels"

EXPOSE 8888
ENTRYPOINT ["tini", "--"]
CMD ["make", "lab"]
